"""Quick-look PNGs of huge rasters: a decimated overview and a class-colour overlay.

>>> with RasterReader("scene.tif") as r:  # doctest: +SKIP
...     image = read_overview(r, max_side=1024)           # [C, h, w], h, w <= 1024
>>> write_preview_png("scene.png", image, mask, num_classes=5)  # doctest: +SKIP
"""

from __future__ import annotations

import colorsys
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from seg_at_scale.errors import InputError
from seg_at_scale.io.raster import RasterReader
from seg_at_scale.io.writer import check_output_path, write_atomic
from seg_at_scale.tiling.geometry import Window

if TYPE_CHECKING:
    from seg_at_scale.io.zarr_raster import ZarrRaster

__all__ = ["DEFAULT_PALETTE", "IGNORE_INDEX", "default_palette", "overview_stride",
           "read_overview", "write_preview_png"]

#: Class id that is never drawn (unlabelled / ignored pixels).
IGNORE_INDEX = 255
#: Distinct colours for the first classes (matplotlib's tab10 order, then a few more).
DEFAULT_PALETTE: tuple[tuple[int, int, int], ...] = (
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
    (255, 255, 0), (0, 255, 255), (255, 0, 255), (128, 0, 0), (0, 0, 128), (0, 128, 0),
)
#: Bytes of decoded rows held at once by :func:`read_overview`.
_BAND_BYTES = 64 * 2**20


def default_palette(num_classes: int) -> list[tuple[int, int, int]]:
    """``num_classes`` distinct colours: :data:`DEFAULT_PALETTE`, then golden-ratio hues."""
    colours = list(DEFAULT_PALETTE[:num_classes])
    for k in range(len(colours), num_classes):
        r, g, b = colorsys.hsv_to_rgb((k * 0.618034) % 1.0, 0.75, 0.95)
        colours.append((round(r * 255), round(g * 255), round(b * 255)))
    return colours


def overview_stride(height: int, width: int, max_side: int) -> int:
    """Smallest integer stride ``s`` with ``ceil(side / s) <= max_side`` for both sides."""
    return max(1, -(-max(height, width) // max_side))


def read_overview(reader: RasterReader | ZarrRaster, max_side: int = 1024) -> np.ndarray:
    """Read a decimated view ``image[:, ::s, ::s]`` read band by band with bounded memory.

    Args:
        reader: an open raster.
        max_side: longest side of the result; the stride is :func:`overview_stride`.

    Returns:
        ``[C, ceil(H / s), ceil(W / s)]`` in the file's dtype.

    """
    if max_side < 1:
        raise InputError(f"read_overview of '{reader.path}': max_side={max_side}; use >= 1")
    c, h, w = reader.shape
    s = overview_stride(h, w, max_side)
    row_bytes = c * w * reader.dtype.itemsize
    step = max(s, _BAND_BYTES // row_bytes // s * s)  # a multiple of s: phase stays at 0
    parts = []
    for r0 in range(0, h, step):
        band = reader.read(Window(r0, 0, min(step, h - r0), w))
        parts.append(band[:, ::s, ::s].copy())  # copy: do not pin the full band
    return np.concatenate(parts, axis=1)


def _stretch(band: np.ndarray) -> np.ndarray:
    """2-98 percentile stretch of one band ``[h, w]`` to uint8 (NaN -> 0)."""
    x = band.astype(np.float64)
    finite = x[np.isfinite(x)]
    if finite.size == 0:
        return np.zeros(x.shape, np.uint8)
    lo, hi = np.percentile(finite, [2.0, 98.0])
    scaled = (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)
    scaled = np.nan_to_num(np.clip(scaled, 0.0, 1.0), nan=0.0)
    return np.round(scaled * 255.0).astype(np.uint8)


def _to_rgb(image: np.ndarray) -> np.ndarray:
    """``[C, h, w]`` -> ``[h, w, 3]`` uint8: bands 0-2 as RGB, or band 0 as gray."""
    bands = image[:3] if image.shape[0] >= 3 else image[:1].repeat(3, axis=0)
    return np.stack([_stretch(b) for b in bands], axis=-1)


def _check_mask(path: Path, mask: np.ndarray, shape: tuple[int, int], num_classes: int) -> None:
    if mask.shape != shape:
        raise InputError(f"preview '{path}': mask is {mask.shape[0]}x{mask.shape[1]} "
                         f"but image is {shape[0]}x{shape[1]}; pass a mask of the image's size")
    bad = (mask < 0) | ((mask >= num_classes) & (mask != IGNORE_INDEX))
    if bad.any():
        raise InputError(f"preview '{path}': mask holds class id {int(mask[bad].flat[0])} "
                         f"but num_classes={num_classes}; ids must be < {num_classes} or "
                         f"{IGNORE_INDEX} (ignore)")


def write_preview_png(path: str | os.PathLike[str], image: np.ndarray,
                      mask: np.ndarray | None, num_classes: int, *, alpha: float = 0.45,
                      palette: Sequence[tuple[int, int, int]] | None = None,
                      overwrite: bool = True) -> Path:
    """Write an RGB preview, with the mask's class colours blended over it.

    Each masked pixel becomes ``round((1 - alpha) * rgb + alpha * palette[k])``; class id
    255 (ignore) is left undrawn.

    Args:
        path: PNG to write (atomically: temporary name, then rename).
        image: ``[C, h, w]`` any dtype; bands 0-2 shown as RGB (1-2 bands: band 0 as gray),
            each stretched between its 2nd and 98th percentile.
        mask: ``[h, w]`` integer class ids, or None for the image alone.
        num_classes: number of classes (palette entries used).
        alpha: opacity of the class colours.
        palette: RGB per class; default :func:`default_palette`.
        overwrite: replace an existing file.

    Returns:
        ``path``.

    """
    out = check_output_path(path, overwrite, key="preview")
    image = np.asarray(image)
    if image.ndim != 3:
        raise InputError(f"preview '{out}': image has shape {image.shape}; expected [C, h, w]")
    rgb = _to_rgb(image)
    if mask is not None:
        mask = np.asarray(mask)
        _check_mask(out, mask, rgb.shape[:2], num_classes)
        colours = np.asarray(palette if palette is not None else default_palette(num_classes),
                             np.float64).reshape(-1, 3)
        if len(colours) < num_classes:
            raise InputError(f"preview '{out}': palette has {len(colours)} colours for "
                             f"{num_classes} classes; give one colour per class")
        drawn = mask != IGNORE_INDEX
        blend = (1.0 - alpha) * rgb[drawn] + alpha * colours[mask[drawn].astype(np.intp)]
        rgb[drawn] = np.round(np.clip(blend, 0, 255)).astype(np.uint8)
    return write_atomic(out, lambda tmp: Image.fromarray(rgb, "RGB").save(tmp, format="PNG"))
