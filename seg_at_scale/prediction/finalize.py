"""Rank 0's last step: the class histogram, then the COG(s) or the store marked complete."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from seg_at_scale.errors import InputError
from seg_at_scale.io import RasterReader
from seg_at_scale.io.cog import class_colors, write_cog
from seg_at_scale.prediction.checks import probabilities_path
from seg_at_scale.prediction.provenance import (
    CLASS_PIXELS_TAG,
    FINGERPRINT_TAG,
    TILING_TAG,
    digest,
)
from seg_at_scale.prediction.store import NODATA, PredictionStore
from seg_at_scale.tiling.geometry import Tile, Window

__all__ = ["finalize", "cog_outputs"]


def cog_outputs(out_path: Path, probabilities: str | None) -> list[Path]:
    """The files a ``.tif`` output makes: the labels, and ``NAME_probabilities.tif``."""
    return [out_path, probabilities_path(out_path)] if probabilities else [out_path]


def finalize(store: PredictionStore, out_path: Path, kind: str, reader: RasterReader,
             names: list[str], probabilities: str | None, overwrite: bool,
             keep_store: bool) -> list[int]:
    """Rank 0: class histogram, then the COG(s) or the store marked complete."""
    missing = [t.index for t in _all_tiles(store) if not store.done(t)]
    if missing:
        raise InputError(f"the store '{store.path}' misses {len(missing)} tiles after every "
                         f"rank finished (first: {missing[0]}); rerun the same command to "
                         "complete them")
    hist = np.zeros(256, np.int64)

    def counted() -> Iterator[np.ndarray]:
        for band in store.row_bands(store.labels):
            hist[:] += torch.bincount(torch.from_numpy(band).reshape(-1), minlength=256).numpy()
            yield band

    h, w = store.labels.shape
    classes = len(names)  # the histogram's length: one count per class of the model
    if kind == "cog":
        if store.probabilities is not None:  # first: the labels' file, last, marks "done"
            k = store.probabilities.shape[0]
            write_cog(cog_outputs(out_path, probabilities)[1], (k, h, w),
                      str(store.probabilities.dtype).replace("float16", "float32"),
                      (b.astype(np.float32) if b.dtype == np.float16 else b
                       for b in store.row_bands(store.probabilities)),
                      geotags=reader.geotags, resampling="average", overwrite=True,
                      descriptions=names[:k])
        fingerprint = cast(dict[str, Any], store.group.attrs["fingerprint"])
        done = digest(dict(fingerprint))
        tiling = ("exact" if fingerprint.get("exact", True) else
                  "approximate: tiling.exact=false, overlapping tiles; not the whole-image "
                  "forward")
        write_cog(out_path, (1, h, w), "uint8", counted(), geotags=reader.geotags,
                  nodata=NODATA, colormap=class_colors(classes), resampling="mode",
                  overwrite=True, tags=lambda: {
                      FINGERPRINT_TAG: done, TILING_TAG: tiling,
                      CLASS_PIXELS_TAG: json.dumps([int(v) for v in hist[:classes]])})
    else:
        for _ in counted():
            pass
    class_pixels = [int(v) for v in hist[:classes]]
    store.finish(class_pixels)
    if kind == "cog" and not keep_store:
        shutil.rmtree(store.path, ignore_errors=True)
    return class_pixels


def _all_tiles(store: PredictionStore) -> Iterator[Any]:
    ch, cw = store.chunk
    h, w = store.labels.shape
    for i, r in enumerate(range(0, h, ch)):
        for j, c in enumerate(range(0, w, cw)):
            core = Window(r, c, min(ch, h - r), min(cw, w - c))
            yield Tile((i, j), core, core, core)
