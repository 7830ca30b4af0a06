"""Which prediction made a finished output: a rerun recognises its own work and skips it.

A finished ``.tif`` carries the digest of its fingerprint (model weights, input file,
grid, precision, TTA, ...) and its class histogram as GDAL metadata tags; a finished
``.zarr`` store carries the fingerprint itself. So rerunning the same command over a
finished output (or an archive whose scenes are partly finished) skips what is done,
completes what is missing (a preview, vectors, a STAC Item killed before being written),
and refuses an output another prediction made unless ``overwrite=true``.

>>> digest({"model": "ab", "grid": [1, 2]}) == digest({"grid": [1, 2], "model": "ab"})
True
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

__all__ = ["digest", "finished", "FINGERPRINT_TAG", "CLASS_PIXELS_TAG"]

FINGERPRINT_TAG = "SEG_AT_SCALE_FINGERPRINT"
CLASS_PIXELS_TAG = "SEG_AT_SCALE_CLASS_PIXELS"


def digest(fingerprint: dict[str, Any]) -> str:
    """SHA-256 of a fingerprint's canonical JSON."""
    text = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def finished(output: Path) -> tuple[str, list[int]] | None:
    """``(fingerprint digest, class pixels)`` of a finished prediction at ``output``.

    None when there is nothing there, or something that is not a finished seg_at_scale
    prediction (a file of the user's, an interrupted store).
    """
    if not output.exists():
        return None
    if output.suffix.lower() == ".zarr":
        return _finished_store(output)
    import rasterio
    from rasterio.errors import NotGeoreferencedWarning, RasterioIOError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGeoreferencedWarning)
            with rasterio.open(output) as ds:
                tags = ds.tags()
    except (RasterioIOError, OSError):
        return None
    if FINGERPRINT_TAG not in tags:
        return None
    return tags[FINGERPRINT_TAG], json.loads(tags.get(CLASS_PIXELS_TAG, "[]"))


def _finished_store(path: Path) -> tuple[str, list[int]] | None:
    import zarr

    try:
        attrs = dict(zarr.open_group(path, mode="r").attrs)
    except (ValueError, KeyError, FileNotFoundError, OSError):
        return None
    if not attrs.get("complete") or "fingerprint" not in attrs:
        return None
    return digest(attrs["fingerprint"]), list(attrs.get("class_pixels") or [])
