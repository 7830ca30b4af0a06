"""Preflight: every split's files checked before the first training step.

Without it a NaN in a validation image surfaced at the first validation (an epoch lost)
and a truncated test image after ``fit``. :func:`preflight` runs two passes over the
``train``, ``val`` (and ``test``) scenes under a data root:

1. **headers** (every file, fast): readable and not truncated, mask size equal to the image
   size, image bands equal to ``data.bands``, mask bands and integer samples, one image
   dtype across splits, and that dtype against ``data.scale`` (uint16 imagery with the
   uint8 scale 1/255 reaches ~257, not ~1);
2. **pixels** (streamed, row band by row band): label values against
   ``data.num_classes`` (the class histogram exact grid training needs comes from the same
   pass), NaN in float imagery without a nodata value (outside GDAL's internal mask).

The pixel facts are cached per file in a small JSON file (:data:`CACHE_NAME` in the data
root), keyed by path, size and modification time, so a rerun reads headers only. A
:class:`PreflightReport` hands the validated scenes (class counts filled) to the
DataModule, so nothing is read twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from seg_at_scale.data.scenes import (
    Scene,
    check_labels,
    check_mask_covers,
    check_mask_header,
    find_scenes,
    label_counts,
    stream_rows,
)
from seg_at_scale.errors import ConfigError, InputError
from seg_at_scale.io import RasterReader
from seg_at_scale.tiling import Window

__all__ = ["preflight", "PreflightReport", "FactCache", "CACHE_NAME", "check_scale",
           "check_learnable"]

log = logging.getLogger(__name__)

CACHE_NAME = ".seg_at_scale_preflight.json"
FACTS_VERSION = 1
SCALE_RANGE = (1 / 16, 16.0)  # scale x dtype max must land within: inputs of about 0..1


class FactCache:
    """Per-file facts in a JSON file, valid while the file's size and mtime are unchanged.

    Args:
        path: the JSON file, or None for no cache. An unwritable place only costs a
            warning (the checks still run).
    """

    def __init__(self, path: Path | None) -> None:
        self.path, self.hits, self.misses = path, 0, 0
        self.data: dict[str, Any] = {}
        if path is not None and path.exists():
            try:
                loaded = json.loads(path.read_text())
                if loaded.get("version") == FACTS_VERSION:
                    self.data = loaded.get("files", {})
            except (OSError, ValueError) as exc:
                log.warning("preflight cache '%s' unreadable (%s): starting afresh", path, exc)

    def facts(self, file: Path, kind: str, compute: Callable[[], Any]) -> Any:
        """The cached ``kind`` facts of ``file``, or ``compute()`` (then cached)."""
        st = file.stat()
        key = f"{kind}:{file.resolve()}"
        entry = self.data.get(key)
        if entry and entry["size"] == st.st_size and entry["mtime_ns"] == st.st_mtime_ns:
            self.hits += 1
            return entry["facts"]
        self.misses += 1
        value = compute()
        self.data[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "facts": value}
        return value

    def save(self) -> None:
        """Write the cache atomically (a temporary file renamed)."""
        if self.path is None or not self.misses:
            return
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
            with os.fdopen(fd, "w") as f:
                json.dump({"version": FACTS_VERSION, "files": self.data}, f)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("preflight cache not written to '%s' (%s): the next run checks the "
                        "pixels again", self.path, exc)


@dataclass
class PreflightReport:
    """What :func:`preflight` found.

    Attributes:
        scenes: validated scenes per split (``class_counts`` filled).
        shapes: ``(height, width)`` of every image.
        dtype: the images' sample type (one for all).
        seconds: wall time of the checks.
        cached: files whose pixel facts came from the cache.
        checked: files whose pixels were read.
    """

    scenes: dict[str, list[Scene]]
    shapes: dict[Path, tuple[int, int]] = field(default_factory=dict)
    dtype: np.dtype = field(default_factory=lambda: np.dtype(np.uint8))
    seconds: float = 0.0
    cached: int = 0
    checked: int = 0

    def summary(self) -> str:
        n = sum(len(s) for s in self.scenes.values())
        splits = ", ".join(f"{k} {len(v)}" for k, v in self.scenes.items())
        return (f"preflight: {n} scenes ({splits}), {self.dtype} imagery, checked in "
                f"{self.seconds:.2f} s (pixels read for {self.checked} files, "
                f"{self.cached} from the cache)")


def check_scale(path: Path, dtype: np.dtype, scale: float) -> None:
    """Refuse a fixed ``data.scale`` that maps an integer dtype far outside ``0..1``."""
    if not np.issubdtype(dtype, np.integer):
        return
    top = float(np.iinfo(dtype).max) * scale
    if SCALE_RANGE[0] <= top <= SCALE_RANGE[1]:
        return
    raise ConfigError(
        f"data.scale={scale:.6g} maps '{path}' ({dtype}, 0..{np.iinfo(dtype).max}) to "
        f"0..{top:.4g}; the model expects inputs of about 0..1. Use data.scale=auto (from the "
        "dtype and the training data; data.mean=auto data.std=auto for per-band statistics), "
        "or data.scale=1/<your sensor's largest value>, e.g. 0.0001 for Sentinel-2 L2A "
        "reflectances")


def _check_header(scene: Scene, bands: int, mask_bands: int) -> tuple[tuple[int, int], np.dtype]:
    """Open the scene's files (readable, not truncated); sizes, bands, mask type."""
    with RasterReader(scene.image) as image:
        if image.bands != bands:
            raise InputError(f"'{scene.image}' has {image.bands} bands but data.bands={bands}; "
                             f"set data.bands={image.bands} (the model's input channels) or "
                             "give images with that many bands")
        if scene.mask is not None:
            with RasterReader(scene.mask) as mask:
                check_mask_covers(mask, image)
                check_mask_header(mask, mask_bands)
        return (image.height, image.width), image.dtype


def _first_nan_row(image: RasterReader) -> int | None:
    """First row holding NaN at a valid pixel (GDAL's mask honoured), or None."""
    step = stream_rows(image)
    for r0 in range(0, image.height, step):
        window = Window(r0, 0, min(step, image.height - r0), image.width)
        nan = np.isnan(image.read(window)).any(axis=0)
        valid = image.read_mask(window)
        hits = np.flatnonzero((nan if valid is None else nan & valid).any(axis=1))
        if hits.size:
            return r0 + int(hits[0])
    return None


def _check_pixels(scene: Scene, cache: FactCache, num_classes: int, ignore_index: int,
                  nodata: float | None) -> int:
    """Label range and class counts of the mask; NaN in a float image.

    Returns:
        The mask's pixels of ``ignore_index`` (0 without a mask).
    """
    with RasterReader(scene.image, nodata=nodata) as image:
        if image.is_float and not (image.nodata is not None and math.isnan(image.nodata)):
            row = cache.facts(scene.image, "nan_row", lambda: _first_nan_row(image))
            if row is not None:
                raise InputError(
                    f"'{scene.image}' has NaN pixels (first in row {row}) and "
                    f"{'no nodata value' if image.nodata is None else f'nodata={image.nodata}'}"
                    "; set data.nodata=nan so they are masked (predicted 255, no loss), or "
                    "clean the file")
    if scene.mask is None:
        return 0
    with RasterReader(scene.mask) as mask:
        counts = cache.facts(scene.mask, "labels",
                             lambda: {str(k): v for k, v in label_counts(mask).items()})
        scene.class_counts = check_labels(mask, {int(k): v for k, v in counts.items()},
                                          num_classes, ignore_index)
    return int(counts.get(str(ignore_index), 0))


def check_learnable(split: Path, scenes: Sequence[Scene], num_classes: int, ignore_index: int,
                    ignored: int) -> None:
    """Refuse training masks that hold fewer than two classes.

    A network learns nothing from them; the usual cause is a binary mask written 0 / 255
    (the foreground then reads as ``ignore_index``, without loss), and training would run
    to the end on the background alone.

    Args:
        split: the training split's folder (for the message).
        scenes: its scenes, ``class_counts`` filled.
        num_classes: ``data.num_classes``.
        ignore_index: ``data.ignore_index``.
        ignored: the masks' pixels of ``ignore_index``.

    Raises:
        InputError: naming the classes found, the ignored pixels and the fix.
    """
    if num_classes < 2 or not any(s.mask is not None for s in scenes):
        return
    totals = np.sum([s.class_counts for s in scenes if s.mask is not None], axis=0)
    present = [k for k in range(num_classes) if totals[k] > 0]
    if len(present) >= 2:
        return
    found = (f"only class {present[0]} ({int(totals[present[0]])} pixels)" if present
             else "no labelled pixel")
    why = (f", and {ignored} pixels of {ignore_index} (data.ignore_index: no loss)" if ignored
           else "")
    fix = (f"binary masks written 0 / {ignore_index}? Write the foreground as 1 (e.g. "
           "gdal_calc.py -A <mask> --calc='A>0' --type=Byte --outfile=<new mask>)" if ignored
           else f"give masks that hold the labels 0..{num_classes - 1}")
    raise InputError(f"the training masks under '{split}' hold {found}{why}: a network cannot "
                     f"learn {num_classes} classes from them; {fix}")


def preflight(root: str | os.PathLike[str], splits: Sequence[str], *, bands: int,
              num_classes: int, ignore_index: int = 255, mask_bands: int = 1,
              nodata: float | None = None, scale: float | None = None,
              cache: Path | None = None) -> PreflightReport:
    """Check every scene of ``splits`` under ``root``; see the module docstring.

    Args:
        root: the data root (``<root>/<split>/``: :func:`~.scenes.find_scenes`'s layouts).
        splits: the splits the run reads (``train``, ``val``; ``test`` when it predicts).
        bands: ``data.bands``.
        num_classes: ``data.num_classes``.
        ignore_index: the label without loss.
        mask_bands: label bands per mask.
        nodata: ``data.nodata`` (overrides the files' tags).
        scale: a fixed ``data.scale`` to check against the dtype, or None (``auto``).
        cache: the JSON cache of pixel facts, or None.

    Raises:
        InputError: a file is unreadable or inconsistent (named, with the fix).
        ConfigError: ``data.bands`` or ``data.scale`` does not fit the files.
    """
    start = time.perf_counter()
    report = PreflightReport({s: find_scenes(Path(root) / s, key=f"data.root ({s} split)")
                              for s in splits})
    dtypes: dict[Path, np.dtype] = {}
    for found in report.scenes.values():
        for scene in found:
            report.shapes[scene.image], dtypes[scene.image] = _check_header(
                scene, bands, mask_bands)
    report.dtype = _one_dtype(dtypes)
    if scale is not None:
        check_scale(next(iter(dtypes)), report.dtype, scale)
    store = FactCache(cache)
    ignored = 0  # the training masks' pixels of ignore_index
    for split, found in report.scenes.items():
        for scene in found:
            n = _check_pixels(scene, store, num_classes, ignore_index, nodata)
            ignored += n if split == "train" else 0
    store.save()
    if "train" in report.scenes:
        check_learnable(Path(root) / "train", report.scenes["train"], num_classes,
                        ignore_index, ignored)
    report.cached, report.checked = store.hits, store.misses
    report.seconds = time.perf_counter() - start
    log.info(report.summary())
    return report


def _one_dtype(dtypes: dict[Path, np.dtype]) -> np.dtype:
    """The images' common dtype; refuses a mix (one scale cannot fit two ranges)."""
    first, dtype = next(iter(dtypes.items()))
    for path, other in dtypes.items():
        if other != dtype:
            raise InputError(f"'{path}' is {other} but '{first}' is {dtype}; one data.scale "
                             "cannot fit both: convert the images to one sample type")
    return dtype
