"""One writer per output: an exclusive lock held for the whole run.

A second run writing the same output is refused at once, naming the lock file, instead of
both writing one file (``filelock``: an ``flock`` on a hidden file beside the output,
released by the kernel if the holder dies, so a killed run never blocks the next). The
file is removed when the run ends; a killed run's stays, empty and unlocked, and the next
run takes it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from seg_at_scale.errors import ConfigError, OutputExistsError

__all__ = ["output_lock", "lock_path"]


def lock_path(output: Path) -> Path:
    """The hidden lock file of ``output``."""
    return output.with_name(f".{output.name}.lock")


@contextlib.contextmanager
def output_lock(output: Path, what: str | None = None) -> Iterator[Path]:
    """Hold ``output``'s lock; refuse at once if another process holds it.

    ``what`` names the output in the refusal (default ``output '<output>'``).
    """
    folder = output.parent if str(output.parent) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"output='{output}': cannot create its folder ({exc}); choose "
                          "a writable location") from exc
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"output='{output}': the folder '{folder}' is not writable; "
                          "choose a writable location")
    path = lock_path(output)
    lock = FileLock(path, timeout=0)
    named = what or f"output '{output}'"
    try:
        lock.acquire()
    except Timeout as exc:
        raise OutputExistsError(
            f"{named} is being written by another run (its lock '{path}' is held); wait for "
            "it to finish or choose another output") from exc
    try:
        yield path
    finally:
        # Unlinked while still held: a waiter that opened the old file finds it unlinked
        # once it gets the flock and retries on a new one (filelock checks st_nlink), so
        # removing it is safe and leaves nothing beside the output.
        path.unlink(missing_ok=True)
        lock.release()
