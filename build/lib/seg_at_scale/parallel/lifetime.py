"""Child processes that never outlive the process that started them.

A forked prediction rank whose launcher was SIGKILLed ran on, finished, and held the
output's lock meanwhile, so the user's rerun was refused. On Linux the kernel can send a
child a signal when its parent dies (``prctl(PR_SET_PDEATHSIG)``); elsewhere a daemon
thread watches the parent's pid. Either way the child's locks go with it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

__all__ = ["die_with_parent"]

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
