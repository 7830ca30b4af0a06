"""One process at a time: an advisory lock file around work several processes may start at once.

Trials launched side by side (``hydra/launcher=local_parallel``), DDP ranks and SLURM array
jobs all call the training entry point, which generates the synthetic dataset when it is
missing; without a lock two of them write the same files and one fails. The first to take
the lock generates, the others wait and then find the dataset made.

>>> with exclusive("/tmp/seg_at_scale_doctest.lock"):
...     pass
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["exclusive"]


@contextlib.contextmanager
def exclusive(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created) for the block; a no-op without fcntl."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
