"""Input normalisation that fits the data: ``data.scale`` / ``mean`` / ``std`` = ``auto``.

The model sees ``(x * scale - mean) / std`` per band. The uint8 convention (scale 1/255,
mean 0.5, std 0.25) is wrong by orders of magnitude for uint16 or float imagery
(Sentinel-2 and Landsat reflectances run to ~10,000; 1/255 maps them to ~40). ``auto``
works the numbers out once, from a sample of the training split:

* ``scale``: 1/255 for uint8; for any other dtype 1 / the largest band's
  ``mean + 3 std``, so nearly all pixels land in ``[0, 1]`` (where the photometric
  augmentations act);
* ``mean``, ``std``: per band, of the scaled samples.

No-data pixels (the nodata value, GDAL's internal mask) are left out. The numbers are saved
in the run's config (``data.scale``, ``data.mean``, ``data.std``, plus
``computed.normalization``), which is where ``seg-predict`` builds its normaliser from.

>>> s = BandSums.of(np.array([[[0, 2], [4, 6]]], np.uint16), None)  # mean 3, std 2.24
>>> auto_normalization(np.dtype("uint16"), s, "auto", "auto", "auto")
{'scale': 0.10300566479164913, 'mean': [0.309017], 'std': [0.230328]}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from seg_at_scale.data.config import AUTO
from seg_at_scale.io import RasterReader
from seg_at_scale.io.valid import read_valid
from seg_at_scale.tiling import Window

__all__ = ["BandSums", "sample_sums", "auto_normalization", "SAMPLE_SIDE", "SAMPLE_GRID"]

SAMPLE_SIDE, SAMPLE_GRID = 256, 4  # a scene's sample: up to 4 x 4 windows of 256^2
SPREAD = 3.0  # scale = 1 / max over bands of (mean + SPREAD * std), raw units
MIN_STD = 1e-6


@dataclass
class BandSums:
    """Per-band count, sum, sum of squares of valid samples (raw units, float64)."""

    count: np.ndarray
    total: np.ndarray
    squares: np.ndarray

    @classmethod
    def of(cls, raw: np.ndarray, valid: np.ndarray | None) -> BandSums:
        """Sums of ``raw [C, h, w]`` over pixels where ``valid [h, w]`` (None: all)."""
        x = raw.reshape(raw.shape[0], -1).astype(np.float64)
        if valid is not None:
            x = x[:, valid.ravel()]
        return cls(np.full(raw.shape[0], x.shape[1], np.float64), x.sum(1), (x * x).sum(1))

    def __add__(self, other: BandSums) -> BandSums:
        return BandSums(self.count + other.count, self.total + other.total,
                        self.squares + other.squares)

    def to_json(self) -> dict[str, list[float]]:
        return {"count": self.count.tolist(), "total": self.total.tolist(),
                "squares": self.squares.tolist()}

    @classmethod
    def from_json(cls, d: dict[str, list[float]]) -> BandSums:
        return cls(*(np.asarray(d[k], np.float64) for k in ("count", "total", "squares")))

    def mean_std(self) -> tuple[np.ndarray, np.ndarray]:
        n = np.maximum(self.count, 1)
        mean = self.total / n
        return mean, np.sqrt(np.maximum(self.squares / n - mean * mean, 0.0))


def sample_windows(height: int, width: int, side: int = SAMPLE_SIDE,
                   grid: int = SAMPLE_GRID) -> list[Window]:
    """Up to ``grid x grid`` windows of ``side`` spread evenly over an image.

    >>> [(w.row, w.col) for w in sample_windows(300, 1000, side=256, grid=2)]
    [(0, 0), (0, 744), (44, 0), (44, 744)]
    """
    h, w = min(side, height), min(side, width)
    rows = np.unique(np.linspace(0, height - h, grid).round().astype(int))
    cols = np.unique(np.linspace(0, width - w, grid).round().astype(int))
    return [Window(int(r), int(c), h, w) for r in rows for c in cols]


def sample_sums(reader: RasterReader) -> BandSums:
    """:class:`BandSums` of a spread sample of a scene's valid pixels (see module doc)."""
    total: BandSums | None = None
    for window in sample_windows(reader.height, reader.width):
        raw, invalid = read_valid(reader, window, "constant")  # the nodata rule
        valid = reader.read_mask(window)  # GDAL's internal mask
        if invalid is not None:
            valid = ~invalid if valid is None else valid & ~invalid
        part = BandSums.of(raw, valid)
        total = part if total is None else total + part
    assert total is not None
    return total


def auto_normalization(dtype: np.dtype, sums: BandSums, scale: float | str,
                       mean: Sequence[float] | str, std: Sequence[float] | str
                       ) -> dict[str, Any]:
    """``{"scale", "mean", "std"}`` with each ``'auto'`` worked out from ``sums``.

    Values given as numbers are kept as they are.
    """
    raw_mean, raw_std = sums.mean_std()
    if scale == AUTO:
        if dtype == np.uint8:
            scale = 1 / 255
        else:
            high = float(np.max(raw_mean + SPREAD * raw_std))
            scale = 1.0 / high if high > 0 else 1.0
    s = float(scale)
    if mean == AUTO:
        mean = [round(float(m * s), 6) for m in raw_mean]
    if std == AUTO:
        std = [round(max(float(v * s), MIN_STD), 6) if v * s > MIN_STD else 1.0
               for v in raw_std]
    return {"scale": s, "mean": list(mean), "std": list(std)}
