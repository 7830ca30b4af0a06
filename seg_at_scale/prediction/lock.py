"""One writer per output: an exclusive lock held for the whole run.

A second run writing the same output is refused at once, naming the lock file, instead of
both writing one file (``filelock``: an ``flock`` on a hidden file beside the output,
released by the kernel if the holder dies, so a killed run never blocks the next). The
file is removed when the run ends; a killed run's stays, empty and unlocked, and the next
run takes it.

Every writer of a scene's output goes through this module, a one-scene run and an archive
alike, so the two never write one scene at once (both would write the scene's store, and
one of them would find tiles missing):

* a one-scene run holds its output's lock (:func:`scene_lock`, from before its first tile
  until its preview, polygons and STAC Item are written) and, once it holds it, is refused
  if a running archive has claimed that output;
* an archive claims its scenes' outputs (:func:`archive_claim`): it holds one lock per
  output folder (``.archive.scenes.lock``) and lists the outputs beside it
  (``.archive.scenes.json``), then takes and releases each output's lock: a scene that a
  one-scene run is writing is refused. One open file per folder, not per scene: an archive
  may hold more scenes than the open-file limit.

Whichever starts second sees the first: the one-scene run locks before it reads the list,
the archive lists before it tries the locks.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from filelock import FileLock, Timeout

from seg_at_scale.errors import ConfigError, OutputExistsError, SegAtScaleError

__all__ = ["output_lock", "lock_path", "scene_lock", "archive_claim", "CLAIM"]

CLAIM = "archive.scenes"  # .archive.scenes.lock / .json: an archive's claim on a folder
_RASTERS = (".tif", ".tiff", ".zarr")  # outputs whose companions are named by their stem
_HELD: set[str] = set()  # outputs this process holds (scene_lock) or claimed (archive_claim)


def _companions_of(output: Path) -> Path:
    """What an output's lock stands for: a raster output together with its companions.

    ``NAME.tif``, ``NAME.tiff`` and ``NAME.zarr`` share their companions
    (``NAME_preview.png``, ``NAME.stac.json``, ...), hence one lock.
    """
    if output.suffix.lower() in _RASTERS:
        return output.with_name(f"{output.stem}.output")
    return output


def lock_path(output: Path) -> Path:
    """The hidden lock file of ``output`` (``.NAME.output.lock`` for ``NAME.tif``)."""
    return output.with_name(f".{_companions_of(output).name}.lock")


def _claim_list(folder: Path) -> Path:
    return folder / f".{CLAIM}.json"


def _key(output: Path) -> str:
    return os.path.realpath(_companions_of(output))


@contextlib.contextmanager
def output_lock(output: Path, what: str | None = None) -> Iterator[Path]:
    """Hold ``output``'s lock; refuse at once if another process holds it.

    Also refused when a running archive has claimed ``output`` (:func:`archive_claim`).
    ``what`` names the output in the refusal (default ``output '<output>'``). Inside this
    process's :func:`scene_lock` (or archive claim) of the same output, it is that lock.
    """
    if _key(output) in _HELD:
        yield lock_path(output)
        return
    with _locked(output, what, claims=output.name != CLAIM) as path:
        yield path


@contextlib.contextmanager
def _locked(output: Path, what: str | None, *, claims: bool) -> Iterator[Path]:
    folder = output.parent if str(output.parent) else Path(".")
    named = what or f"output='{output}'"  # an archive's: output_dir '<folder>'
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"{named}: '{folder}' is a file, where a folder is written; choose "
                          "another path") from None
    except OSError as exc:
        raise ConfigError(f"{named}: cannot create its folder ({exc}); choose a writable "
                          "location") from exc
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"{named}: the folder '{folder}' is not writable; choose a "
                          "writable location")
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
        claimed = _claimed(output) if claims else None
        if claimed is not None:
            raise OutputExistsError(
                f"{named} is being written by an archive (its lock '{claimed}' is held); "
                "wait for it to finish or choose another output")
        yield path
    finally:
        # Unlinked while still held: a waiter that opened the old file finds it unlinked
        # once it gets the flock and retries on a new one (filelock checks st_nlink), so
        # removing it is safe and leaves nothing beside the output.
        path.unlink(missing_ok=True)
        lock.release()


def _claimed(output: Path) -> Path | None:
    """The lock of a running archive whose claim lists ``output`` (None: no such archive).

    A claim left by a killed archive is unlocked, and ignored.
    """
    folder = output.parent if str(output.parent) else Path(".")
    claim = lock_path(folder / CLAIM)
    try:
        fd = os.open(claim, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        pass  # held: an archive is running
    else:
        return None  # nobody holds it (closing the file releases it)
    finally:
        os.close(fd)
    try:
        listed = set(json.loads(_claim_list(folder).read_text()))
    except (OSError, ValueError, TypeError):
        return None  # not listed yet: the archive tries this output's lock after listing
    return claim if _key(output) in listed else None


@contextlib.contextmanager
def scene_lock(output: Path, what: str | None = None) -> Iterator[Path]:
    """Hold the lock of a scene's ``output`` for a one-scene run (module docstring).

    Nested in this process (the one-scene path locks again inside; an archive's scene
    predicted by the one-scene path), the outer one holds it. ``seg-predict`` takes it
    first thing, before torch is imported, so that of two commands the first started wins:
    for its output, or for an archive's own lock ``<output_dir>/archive`` (``what`` names
    output_dir in the refusal); the ranks it forks hold it with it.
    """
    key = _key(output)
    if key in _HELD:
        yield lock_path(output)
        return
    with output_lock(output, what) as path:
        _HELD.add(key)
        try:
            yield path
        finally:
            _HELD.discard(key)


@contextlib.contextmanager
def archive_claim(outputs: Sequence[Path]) -> Iterator[dict[int, str]]:
    """Claim an archive's scene ``outputs`` for as long as this is held (module docstring).

    Yields the refused ones, ``{index in outputs: reason}``: a scene a one-scene run is
    writing (its lock is held), or a folder that cannot hold a lock.

    Raises:
        OutputExistsError: another archive claims one of the folders.
    """
    refused: dict[int, str] = {}
    by_folder: dict[str, list[int]] = {}
    for i, out in enumerate(outputs):
        by_folder.setdefault(os.path.realpath(out.parent if str(out.parent) else "."),
                             []).append(i)
    with contextlib.ExitStack() as stack:
        for folder, members in by_folder.items():
            try:
                stack.enter_context(_locked(Path(folder) / CLAIM, f"output_dir '{folder}'",
                                            claims=False))
            except ConfigError as exc:  # a folder that cannot be written
                refused.update({i: str(exc) for i in members})
                continue
            listed = _claim_list(Path(folder))
            stack.callback(listed.unlink, missing_ok=True)
            _write_list(listed, [_key(outputs[i]) for i in members])
        for i, out in enumerate(outputs):
            if i in refused:
                continue
            try:  # a one-scene run writing it holds this lock
                with _locked(out, None, claims=False):
                    pass
            except SegAtScaleError as exc:
                refused[i] = str(exc)
        mine = {_key(o) for i, o in enumerate(outputs) if i not in refused} - _HELD
        _HELD.update(mine)
        try:
            yield refused
        finally:
            _HELD.difference_update(mine)


def _write_list(path: Path, outputs: list[str]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(outputs))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
