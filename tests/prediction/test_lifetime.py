"""A forked rank dies with its launcher, even one SIGKILLed while the rank ignores signals.

Before, torch's launcher armed only SIGINT for a rank whose parent dies; a rank busy in a
long C call (a convolution, a gloo barrier) ran on, finished, and held the output's lock,
so the user's rerun was refused.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

_PARENT = """
import os, signal, sys, time
from seg_at_scale.parallel.lifetime import die_with_parent
launcher = os.getpid()
pid = os.fork()
if pid == 0:
    if sys.argv[2] == "armed":
        die_with_parent(launcher)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a rank deep in a C call: no handler
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # runs, as if it ignored them
    open(sys.argv[1], "w").write(str(os.getpid()))
    time.sleep(120)
    os._exit(0)
time.sleep(120)
"""


def _child_after_parent_killed(tmp_path: Path, mode: str) -> psutil.Process:
    pid_file = tmp_path / f"child_{mode}"
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(pid_file), mode])
    deadline = time.time() + 60
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.time() < deadline and parent.poll() is None
        time.sleep(0.05)
    child = psutil.Process(int(pid_file.read_text()))
    parent.send_signal(signal.SIGKILL)
    parent.wait(30)
    return child


def _gone(proc: psutil.Process, seconds: float) -> bool:
    try:
        proc.wait(seconds)
    except psutil.TimeoutExpired:
        return False
    return True


def test_an_armed_child_dies_with_its_sigkilled_parent(tmp_path):
    child = _child_after_parent_killed(tmp_path, "armed")
    assert _gone(child, 30)


def test_without_it_the_child_outlives_its_parent(tmp_path):
    """The control: the same child, not armed, is still running (so the test above can
    fail)."""
    child = _child_after_parent_killed(tmp_path, "plain")
    try:
        assert not _gone(child, 2) and child.is_running()
    finally:
        child.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_child_whose_parent_is_already_gone_exits_at_once(tmp_path):
    code = ("import os, sys\n"
            "from seg_at_scale.parallel.lifetime import die_with_parent\n"
            "die_with_parent(parent=1)\n"  # not our parent: it is 'gone'
            "sys.exit(0)\n")
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == -signal.SIGKILL
