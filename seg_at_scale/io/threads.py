"""This process's threads for pixel work: decoding a window's segments, finalising a COG.

One pool, a thread per core (at most 16), shared by the readers' decoders and the row
bands' per-pixel passes (a class histogram, mode overviews), so that together they never
ask for more threads than the cores. The codecs, numpy and torch release the GIL in them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["pixel_threads", "thread_count", "by_rows"]

T = TypeVar("T")

#: The pool's threads' name prefix (a job on one of them runs its pieces itself).
PREFIX = "pixels"
#: Pixels below which a band is one piece: handing it to threads costs more than it saves.
PIECE_PIXELS = 1 << 20

_POOL: tuple[int, int, ThreadPoolExecutor] | None = None  # pid, threads, pool


def pixel_threads() -> ThreadPoolExecutor:
    """The pool: made on first use, and again after a fork (a child inherits no threads)."""
    return _pool()[2]


def thread_count() -> int:
    """The pool's threads: one per core this process may use, at most 16."""
    return _pool()[1]


def _pool() -> tuple[int, int, ThreadPoolExecutor]:
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
        threads = max(1, min(16, cores))
        _POOL = (os.getpid(), threads, ThreadPoolExecutor(threads, thread_name_prefix=PREFIX))
    return _POOL


def by_rows(fn: Callable[[int, int], T], rows: int, width: int, *,
            multiple: int = 1) -> list[T]:
    """``fn(r0, r1)`` over consecutive pieces of ``rows`` rows ``width`` pixels wide.

    The pieces (each a multiple of ``multiple`` rows, but the last) run on the pool's
    threads, a few per thread; a band under :data:`PIECE_PIXELS` per thread, or a call
    from one of the pool's own threads, runs as one piece here. Results in row order.
    """
    _, threads, pool = _pool()
    pieces = min(4 * threads, rows * width // PIECE_PIXELS)
    if pieces < 2 or threading.current_thread().name.startswith(PREFIX):
        return [fn(0, rows)]
    step = -(-rows // pieces)
    step += -step % multiple
    return list(pool.map(lambda r: fn(r, min(r + step, rows)), range(0, rows, step)))
