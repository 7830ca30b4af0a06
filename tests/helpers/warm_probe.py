"""What a started process sees, printed as JSON (``tests/test_warm_processes.py``)."""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time

import torch

if __name__ == "__main__":
    what = {"argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0],
            "probe": os.environ.get("PROBE"), "home": os.environ.get("HOME"),
            "threads": torch.get_num_threads(), "main": __spec__.name,
            "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            "cache": os.environ.get("SEG_AT_SCALE_CACHE"),
            "files": resource.getrlimit(resource.RLIMIT_NOFILE),
            "file_size": resource.getrlimit(resource.RLIMIT_FSIZE),
            "bytecode": not sys.dont_write_bytecode}
    print(json.dumps(what), flush=True)
    print("to stderr", file=sys.stderr)
    if "sleep" in sys.argv:
        time.sleep(60)
    sys.exit(int(sys.argv[1]))
