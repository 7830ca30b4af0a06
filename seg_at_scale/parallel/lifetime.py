"""Child processes that never outlive the process that started them, nor a lost sibling.

A forked prediction rank whose launcher was SIGKILLed ran on, finished, and held the
output's lock meanwhile, so the user's rerun was refused. On Linux the kernel can send a
child a signal when its parent dies (``prctl(PR_SET_PDEATHSIG)``); elsewhere a daemon
thread watches the parent's pid. Either way the child's locks go with it.

The other way round, a rank killed under its launcher (the OOM killer, ``kill -9``) made
torch's launcher stop the others with SIGTERM and wait up to 30 s for any that could not
take it (a rank inside a long C call or a collective): :class:`RankWatch` bounds that wait.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import Any

__all__ = ["die_with_parent", "RankWatch", "STOP_GRACE_S"]

STOP_GRACE_S = 5.0  # a rank told to stop after another was lost: SIGKILLed after this long

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int | None = None, sig: int = signal.SIGKILL) -> None:
    """End this process with ``sig`` as soon as ``parent`` (the pid that forked it) is gone.

    Args:
        parent: the launching process's pid, taken before the fork (default: the current
            parent); if it is already gone, this process exits at once.
        sig: the signal the kernel sends (SIGKILL: no handler can keep the rank alive).
    """
    parent = os.getppid() if parent is None else parent
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), sig)
    if not armed:
        threading.Thread(target=_watch, args=(parent, sig), daemon=True,
                         name="die-with-parent").start()


def _watch(parent: int, sig: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), sig)


class RankWatch:
    """The forked ranks of one launch, seen from the process that forks them.

    Made before the fork (its arrays are shared memory the ranks inherit). Each rank calls
    :meth:`started` first and :meth:`ending` with its exit status before it returns or
    exits by itself; a rank whose process is gone without that was killed by a signal.
    :meth:`watch` (in the launcher) then gives the other ranks ``grace`` seconds to stop
    (torch's launcher has sent them SIGTERM) and SIGKILLs those still running: none waits
    the 30 s torch allows. The ranks' processes are only looked at, never reaped (their
    exit status stays torch's to collect and report).
    """

    RUNNING = -1

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._pids = multiprocessing.RawArray("i", ranks)
        self._status = multiprocessing.RawArray("i", [self.RUNNING] * ranks)
        self._known: dict[int, Any] = {}  # the launcher's: rank -> psutil.Process
        self._done = threading.Event()

    def started(self, rank: int) -> None:
        """In rank ``rank``, first: record its pid."""
        self._pids[rank] = os.getpid()

    def ending(self, rank: int, status: int) -> None:
        """In rank ``rank``: it is about to end by itself with exit ``status``."""
        self._status[rank] = status

    def lost(self) -> list[int]:
        """The ranks whose process is gone without :meth:`ending` (killed by a signal)."""
        return [r for r, proc in self._processes().items()
                if self._status[r] == self.RUNNING and not _running(proc)]

    def watch(self, grace: float = STOP_GRACE_S, poll: float = 0.1) -> None:
        """Start the launcher's watch (a daemon thread, until :meth:`stop`)."""
        threading.Thread(target=self._watch, args=(grace, poll), daemon=True,
                         name="rank-watch").start()

    def stop(self) -> None:
        """End the watch (the launch has returned or raised)."""
        self._done.set()

    def _processes(self) -> dict[int, Any]:
        """The ranks that have started, by rank: their ``psutil.Process``.

        Kept, so that a pid the system gives another process later is never taken for the
        rank's.
        """
        import psutil

        for rank, pid in enumerate(self._pids):
            if pid and rank not in self._known:
                try:
                    self._known[rank] = psutil.Process(pid)
                except psutil.NoSuchProcess:
                    self._known[rank] = None  # gone already
        return self._known

    def _watch(self, grace: float, poll: float) -> None:
        while not self.lost():
            if self._done.wait(poll):
                return
        deadline = time.monotonic() + grace
        while any(_running(p) for p in self._processes().values()):
            if self._done.wait(poll):
                return
            if time.monotonic() > deadline:
                break
        for proc in self._processes().values():
            if _running(proc):
                with contextlib.suppress(Exception):  # ended meanwhile
                    proc.kill()


def _running(proc: Any) -> bool:
    """Whether ``proc`` still runs (a zombie, exited but not yet reaped, does not)."""
    import psutil

    try:
        return proc is not None and proc.is_running() and \
            proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
