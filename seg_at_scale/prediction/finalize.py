"""Rank 0's last step: the class histogram, then the COG(s), or the store published.

It runs after the last tile, or beside the tiles (:class:`RowsOnDisk`): each row band of
the store is read once its chunks are on disk, so the COG's bands are written while the
model computes the rows below them.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from seg_at_scale.errors import InputError
from seg_at_scale.io import RasterReader
from seg_at_scale.io.cog import class_colors, write_cog
from seg_at_scale.io.threads import by_rows
from seg_at_scale.io.writer import discard, remove_stale_temporaries
from seg_at_scale.prediction.checks import probabilities_path
from seg_at_scale.prediction.provenance import (
    CLASS_PIXELS_TAG,
    FINGERPRINT_TAG,
    PREDICTION_TAG,
    PROBABILITIES_OF_TAG,
    TILING_TAG,
    canonical,
    digest,
    owner,
)
from seg_at_scale.prediction.store import NODATA, PredictionStore
from seg_at_scale.tiling.geometry import Tile, Window

__all__ = ["finalize", "cog_outputs", "publish", "RowsOnDisk"]


def cog_outputs(out_path: Path, probabilities: str | None) -> list[Path]:
    """The files a ``.tif`` output makes: the labels, and ``NAME_probabilities.tif``."""
    return [out_path, probabilities_path(out_path)] if probabilities else [out_path]


def finalize(store: PredictionStore, out_path: Path, kind: str, reader: RasterReader,
             names: list[str], probabilities: str | None, overwrite: bool,
             keep_store: bool, ready: RowsOnDisk | None = None) -> list[int]:
    """Rank 0: class histogram, then the COG(s), or the store marked complete and published.

    ``ready``: read each row band once it is on disk (finalising beside the tile writer)
    instead of refusing a store with tiles missing.
    """
    # a killed run's: the COG it wrote beside its tiles, an output it was replacing
    for path in cog_outputs(out_path, probabilities if kind == "cog" else None):
        remove_stale_temporaries(path)
    missing = [] if ready is not None else [t.index for t in _all_tiles(store)
                                            if not store.done(t)]
    if missing:
        raise _missing(store, missing)
    hist = np.zeros(256, np.int64)

    def counted() -> Iterator[np.ndarray]:
        for band in store.row_bands(store.labels, ready):
            hist[:] += _label_counts(band)
            yield band

    h, w = store.labels.shape
    classes = len(names)  # the histogram's length: one count per class of the model
    if kind == "cog":
        fingerprint = cast(dict[str, Any], store.group.attrs["fingerprint"])
        done = digest(dict(fingerprint))
        if store.probabilities is not None:  # first: the labels' file, last, marks "done"
            k = store.probabilities.shape[0]
            write_cog(cog_outputs(out_path, probabilities)[1], (k, h, w),
                      str(store.probabilities.dtype).replace("float16", "float32"),
                      (b.astype(np.float32) if b.dtype == np.float16 else b
                       for b in store.row_bands(store.probabilities, ready)),
                      geotags=reader.geotags, resampling="average", overwrite=True,
                      descriptions=names[:k],
                      tags=lambda: {PROBABILITIES_OF_TAG: owner(done, out_path)},
                      # no data where the labels have none: every probability is a sample
                      valid=(b != NODATA for b in store.row_bands(store.labels, ready)))
        tiling = ("exact" if fingerprint.get("exact", True) else
                  "approximate: tiling.exact=false, overlapping tiles; not the whole-image "
                  "forward")
        write_cog(out_path, (1, h, w), "uint8", counted(), geotags=reader.geotags,
                  nodata=NODATA, colormap=class_colors(classes), resampling="mode",
                  overwrite=True, tags=lambda: {
                      FINGERPRINT_TAG: done, TILING_TAG: tiling,
                      PREDICTION_TAG: canonical(dict(fingerprint)),
                      CLASS_PIXELS_TAG: json.dumps([int(v) for v in hist[:classes]])})
    else:
        for _ in counted():
            pass
    class_pixels = [int(v) for v in hist[:classes]]
    store.finish(class_pixels)
    if kind == "zarr":
        publish(store.path, out_path)
    elif not keep_store:
        discard(store.path, out_path)
    return class_pixels


def publish(store: Path, output: Path) -> None:
    """Rename a complete working store to the ``.zarr`` output's name.

    What is at that name (a finished prediction that ``overwrite=true`` replaces) is
    discarded first (:func:`~seg_at_scale.io.writer.discard`). A run killed in between
    leaves the complete store under its hidden name, and the rerun, which resumes it with
    no tile to compute, publishes it.
    """
    if output.exists():
        discard(output, output)
    os.rename(store, output)


def _label_counts(band: np.ndarray) -> np.ndarray:
    """Pixels per label value (256) of a band ``[h, W]``, counted on the pixel threads."""
    def piece(r0: int, r1: int) -> np.ndarray:
        return torch.bincount(torch.from_numpy(band[r0:r1]).reshape(-1), minlength=256).numpy()

    return cast(np.ndarray, sum(by_rows(piece, *band.shape)))


class RowsOnDisk:
    """Finalising beside the tiles: blocks until a chunk row of ``store`` is on disk.

    Called with a row index by :meth:`~.store.PredictionStore.row_bands`; returns once
    every chunk of that row exists (the tile writer renames each chunk into place). It
    looks again as soon as this process has written a tile (:meth:`wrote`, which the store
    calls: :meth:`~.store.PredictionStore.watch`), and every ``poll_s`` for the chunks
    other ranks write (one process, whose chunks are all its own, needs no short poll).
    After :meth:`abort` (the prediction failed or was interrupted) it raises
    :class:`Aborted` at once instead, and the COG's writer removes its temporary files;
    after :meth:`all_written` (every tile of the run is on disk) it looks at once, and a
    chunk still missing is an error, as after the last tile, instead of a wait without end.
    """

    class Aborted(Exception):
        """The prediction stopped before this row was written."""

    def __init__(self, store: PredictionStore, poll_s: float = 0.02) -> None:
        self.store, self.poll_s = store, poll_s
        self.looks = 0  # how often the store was looked at
        self._stop = threading.Event()
        self._written = threading.Event()
        self._news = threading.Event()  # a tile written here, or either of the two

    def wrote(self) -> None:
        """This process has written a tile."""
        self._news.set()

    def abort(self) -> None:
        self._stop.set()
        self._news.set()

    def all_written(self) -> None:
        self._written.set()
        self._news.set()

    def __call__(self, row: int) -> None:
        tiles = _row_tiles(self.store, row)
        while True:
            self._news.clear()  # before looking: news after the look ends the wait
            if self._stop.is_set():
                raise RowsOnDisk.Aborted(f"the prediction stopped before row {row} of "
                                         f"'{self.store.path}' was written")
            written = self._written.is_set()  # before looking: no write can come after
            self.looks += 1
            tiles = [t for t in tiles if not self.store.done(t)]
            if not tiles:
                return
            if written:
                raise _missing(self.store, [t.index for t in _all_tiles(self.store)
                                            if not self.store.done(t)])
            self._news.wait(self.poll_s)


def _missing(store: PredictionStore, missing: list[tuple[int, int]]) -> InputError:
    return InputError(f"the store '{store.path}' misses {len(missing)} tiles after every rank "
                      f"finished (first: {missing[0]}); rerun the same command to complete "
                      "them")


def _row_tiles(store: PredictionStore, i: int) -> list[Tile]:
    """The chunks of chunk row ``i``, as tiles whose core is the chunk."""
    ch, cw = store.chunk
    h, w = store.labels.shape
    r = i * ch
    return [Tile((i, j), core, core, core) for j, c in enumerate(range(0, w, cw))
            for core in [Window(r, c, min(ch, h - r), min(cw, w - c))]]


def _all_tiles(store: PredictionStore) -> Iterator[Tile]:
    ch = store.chunk[0]
    for i in range(-(-store.labels.shape[0] // ch)):
        yield from _row_tiles(store, i)
