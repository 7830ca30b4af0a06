"""Real processes, started warm: ``seg-train``, ``seg-predict`` and ``seg-synth`` forked
from an interpreter that has already imported the network stack.

A fresh ``python -m seg_at_scale.cli.train`` spends 4-5 CPU-seconds importing torch,
Lightning (and torchmetrics, torchvision, scipy through it) before its first line of work;
the suite starts dozens of them. Here one server per pytest process imports that stack
once and forks a child per command. The child is a real process of its own — its own pid,
exit status and signals (SIGKILL, SIGTERM, SIGINT land on it as on any process), its own
files, environment, working folder, ``sys.argv`` and ``sys.path`` — that runs the module as
``python -m`` would (``runpy``, ``__main__``). What it shares with the server is only what
was imported before the fork, so a test of import order (a refusal before torch is
imported, the output lock before the network stack) starts a fresh process instead. The
server's imported objects are frozen out of the garbage collector, as the commands freeze
theirs (:func:`seg_at_scale.cli.common.long_lived`): a child's collections neither scan
them nor copy the pages they lie on (a tiny ``seg-train`` 1.1-1.4 s here, not 2.8-3.1).

``SEG_TEST_COLD=1`` (``make test-all`` sets it) starts every command fresh.

:func:`run` and :func:`popen` take ``subprocess``'s arguments, and ``limits``: resource limits
the child sets before it runs the module (``{"RLIMIT_FSIZE": (soft, hard)}``: a full disk, too
few open files), which a fresh process gets from a ``preexec_fn``; a command other than
``[sys.executable, "-m", <one of WARM_MODULES>, ...]`` runs through ``subprocess``.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

WARM_MODULES = ("seg_at_scale.cli.train", "seg_at_scale.cli.predict", "seg_at_scale.cli.synth",
                "seg_at_scale.cli.export",
                # the suite's own: tests/test_warm_processes.py, a staged prediction's
                # child, seg-predict with 4 cores reported, seg-predict noting its hashes
                "helpers.warm_probe", "helpers.staged_child", "helpers.four_cores",
                "helpers.noted_hashes")
_PRELOAD = ("numpy", "torch", "pytorch_lightning", "hydra", "omegaconf",
            "seg_at_scale.cli.train", "seg_at_scale.cli.training", "seg_at_scale.cli.predict",
            "seg_at_scale.cli.synth",
            "seg_at_scale.prediction.raster", "seg_at_scale.prediction.archive",
            # what a tiny run imports after those: the training task, the sweeps' record,
            # the COG's and the reader's codecs
            "seg_at_scale.tasks.segmentation", "seg_at_scale.sweeps.record", "rasterio.shutil",
            "rasterio.warp", "imagecodecs")
# the settings tests/conftest.py passes on to every subprocess, given an environment or not
PASSED_ON = ("OMP_WAIT_POLICY", "SEG_AT_SCALE_CACHE")
_SERVER: list[Any] = []  # (Popen of the server, socket path)
_LOCK = threading.Lock()


def passed_on(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the suite's settings (:data:`PASSED_ON`) it lacks."""
    return {**{k: os.environ[k] for k in PASSED_ON if k in os.environ}, **env}


def cold() -> bool:
    """Whether every command starts a fresh interpreter (``SEG_TEST_COLD=1``)."""
    return os.environ.get("SEG_TEST_COLD", "") not in ("", "0")


def _warm_module(cmd: list[str]) -> str | None:
    if cold() or len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-m":
        return None
    return cmd[2] if cmd[2] in WARM_MODULES else None


_POPEN_KEYS = {"env", "cwd", "stdout", "stderr", "text", "start_new_session", "limits"}
_RUN_KEYS = {"capture_output", "text", "env", "cwd", "timeout", "limits"}
Limits = dict[str, tuple[int, int]]  # resource.RLIMIT_* name: (soft, hard)


def _set_limits(limits: Limits) -> None:
    import resource

    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _fresh(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``subprocess``'s arguments for a fresh process: ``limits`` as its ``preexec_fn``."""
    limits = kwargs.pop("limits", None)
    if limits:
        assert "preexec_fn" not in kwargs, "limits= or preexec_fn=, not both"
        kwargs["preexec_fn"] = lambda: _set_limits(limits)
    return kwargs


def popen(cmd: list[str], **kwargs: Any) -> Any:
    """``subprocess.Popen(cmd, **kwargs)``, warm for a ``seg-train`` / ``seg-predict`` module
    (another command, or another keyword such as ``preexec_fn``: ``subprocess.Popen``)."""
    module = _warm_module(cmd)
    if module is None or set(kwargs) - _POPEN_KEYS:
        return subprocess.Popen(cmd, **_fresh(kwargs))
    env, cwd = kwargs.get("env"), kwargs.get("cwd")
    if env is not None:  # as tests/conftest.py passes them on to any subprocess
        env = passed_on(env)
    return WarmProcess(module, cmd, env=dict(os.environ if env is None else env),
                       cwd=os.fspath(cwd or os.getcwd()), stdout=kwargs.get("stdout"),
                       stderr=kwargs.get("stderr"), text=bool(kwargs.get("text")),
                       session=bool(kwargs.get("start_new_session")),
                       limits=kwargs.get("limits") or {})


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, **kwargs)``, warm for a ``seg-train`` / ``seg-predict`` module."""
    if _warm_module(cmd) is None or set(kwargs) - _RUN_KEYS:
        return subprocess.run(cmd, **_fresh(kwargs))
    pipe = subprocess.PIPE if kwargs.get("capture_output") else None
    proc = popen(cmd, env=kwargs.get("env"), cwd=kwargs.get("cwd"), stdout=pipe, stderr=pipe,
                 text=bool(kwargs.get("text")), limits=kwargs.get("limits"))
    try:
        out, err = proc.communicate(timeout=kwargs.get("timeout"))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class WarmProcess:
    """A forked command, driven like ``subprocess.Popen`` (pid, poll, wait, communicate,
    send_signal, terminate, kill, returncode, stdout/stderr pipes)."""

    def __init__(self, module: str, cmd: list[str], *, env: dict[str, str], cwd: str,
                 stdout: Any, stderr: Any, text: bool, session: bool,
                 limits: Limits) -> None:
        self.args = cmd
        self.returncode: int | None = None
        self.stdout: Any = None
        self.stderr: Any = None
        send, close_after = [], []
        for stream, name in ((stdout, "stdout"), (stderr, "stderr")):
            if stream == subprocess.STDOUT:
                send.append(send[0])
                continue
            if stream == subprocess.PIPE:
                r, w = os.pipe()
                setattr(self, name, open(r, "r" if text else "rb", closefd=True))
                send.append(w)
                close_after.append(w)
            elif stream is None:
                send.append(1 if name == "stdout" else 2)
            elif stream == subprocess.DEVNULL:
                w = os.open(os.devnull, os.O_WRONLY)
                send.append(w)
                close_after.append(w)
            else:
                send.append(stream if isinstance(stream, int) else stream.fileno())
        # a fresh process inherits SIGINT ignored from a caller that ignores it (a suite
        # started in the background by a shell); the server's own may differ
        request = json.dumps({"module": module, "args": cmd[3:], "env": env, "cwd": cwd,
                              "session": session, "limits": limits,
                              "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
                              }).encode()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(_server())
        socket.send_fds(self._conn, [struct.pack("!I", len(request))], send)
        self._conn.sendall(request)
        for fd in close_after:
            os.close(fd)
        self._buffer = b""
        self.pid = int(self._line(None))

    def _line(self, timeout: float | None) -> str | None:
        """The server's next line, or None when none came within ``timeout``."""
        end = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if end is None else max(0.0, end - time.monotonic())
            self._conn.settimeout(left)
            try:
                chunk = self._conn.recv(64)
            except (TimeoutError, BlockingIOError):
                return None
            if not chunk:
                raise RuntimeError("the warm-process server ended")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._line(0.0)
            if line is not None:
                self.returncode = os.waitstatus_to_exitcode(int(line))
                self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self.returncode = os.waitstatus_to_exitcode(int(line))
            self._conn.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Read the pipes to their end and wait (as ``Popen.communicate``)."""
        end = None if timeout is None else time.monotonic() + timeout
        streams = [s for s in (self.stdout, self.stderr) if s is not None]
        chunks: dict[Any, list[bytes]] = {s: [] for s in streams}
        with selectors.DefaultSelector() as sel:
            for s in streams:
                sel.register(s.fileno(), selectors.EVENT_READ, s)
            while sel.get_map():
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0)
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        chunks[key.data].append(data)
                    else:
                        sel.unregister(key.fd)
        self.wait(None if end is None else max(0.0, end - time.monotonic()))
        results = []
        for s in (self.stdout, self.stderr):
            if s is None:
                results.append(None)
                continue
            data = b"".join(chunks[s])
            results.append(data.decode() if isinstance(s, io.TextIOBase) else data)
            s.close()
        return results[0], results[1]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


def _server() -> str:
    """The socket of this process's server, started on first use (stopped at exit)."""
    with _LOCK:
        if _SERVER and _SERVER[0].poll() is None:
            return _SERVER[1]
        path = os.path.join(tempfile.mkdtemp(prefix="seg-warm-"), "socket")
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        env.pop("PYTEST_CURRENT_TEST", None)
        # glibc's malloc, whatever the suite runs under (`make test`: tcmalloc): the warm
        # commands write the references that fresh ones, re-executed under tcmalloc, equal
        env.pop("LD_PRELOAD", None)
        proc = subprocess.Popen([sys.executable, __file__, path], env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        end = time.monotonic() + 120
        while not os.path.exists(path + ".ready"):
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the warm-process server did not start ({proc.poll()})")
            time.sleep(0.02)
        _SERVER[:] = [proc, path]
        atexit.register(_stop, proc, path)
        return path


def _stop(proc: subprocess.Popen, path: str) -> None:
    proc.kill()
    proc.wait()
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


# ---- the server (this file run as a script) ------------------------------------------------

def preload(names: Sequence[str]) -> None:
    """Import ``names``, passing over a library this machine does not have at all.

    The lent GPU machine's wheels leave optional codecs out (imagecodecs); a module that is
    there but fails to import, a missing library of its own included, is raised.
    """
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name != name:
                raise


def _serve(path: str) -> None:
    """Import the stack, then fork a child per request; report each child's wait status."""
    import gc

    base = [p for p in sys.path if p != str(Path(__file__).parent)]
    sys.path[:] = base
    gc.disable()  # as the commands import it (seg_at_scale.cli.common.long_lived)
    preload(_PRELOAD)
    from hydra.core.plugins import Plugins

    Plugins.instance()  # Hydra's scan of its plugins, which every command's start makes
    gc.freeze()  # a child's collections neither scan nor copy the server's objects
    gc.enable()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(0.05)
    Path(path + ".ready").touch()
    waiting: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            conn = None
        if conn is not None:
            conn.settimeout(None)
            head, fds, _, _ = socket.recv_fds(conn, 4, 2)
            size = struct.unpack("!I", head)[0]
            body = b""
            while len(body) < size:
                body += conn.recv(size - len(body))
            pid = os.fork()
            if pid == 0:
                for sock in (listener, conn, *waiting.values()):
                    sock.detach()  # closed below by number: no object may close them again
                _child(json.loads(body), fds, base)  # runs the command; never returns
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            done = waiting.pop(pid, None)
            if done is not None:
                try:
                    done.sendall(f"{status}\n".encode())
                except OSError:
                    pass  # the test stopped waiting for it
                done.close()


def _child(request: dict[str, Any], fds: list[int], base: list[str]) -> None:
    """In the forked child: become ``python -m <module> <args>`` in its own setting."""
    import runpy

    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    os.closerange(3, 1 << 16)  # the server's sockets and the fds just received
    if request["session"]:
        os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN if request["sigint_ignored"]
                  else signal.default_int_handler)
    os.chdir(request["cwd"])
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    _set_limits(request["limits"])
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))  # read at start-up
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *extra, *base]
    sys.argv = [request["module"], *request["args"]]
    if env.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    import numpy
    import torch

    numpy.random.seed()  # a fresh interpreter's global state, not the server's
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # read at import by a fresh interpreter
    sys.modules.pop(request["module"], None)  # run as __main__, as by `python -m`
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    raise SystemExit(0)  # the end of the module, as `python -m` ends


if __name__ == "__main__":
    _serve(sys.argv[1])
