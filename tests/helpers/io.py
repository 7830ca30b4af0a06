"""Helpers for tests/io/test_io.py: synthetic arrays and a byte-counting file."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import rasterio


def make_array(shape: tuple[int, ...], dtype: str | np.dtype, seed: int = 0) -> np.ndarray:
    """Random data spanning the dtype's range (floats include negatives and fractions)."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if np.issubdtype(dt, np.floating):
        return (rng.standard_normal(shape) * 100).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, int(info.max) + 1, size=shape, dtype=dt)


class CountingFile(io.FileIO):
    """A binary file that counts every byte handed out by ``read`` / ``readinto``."""

    count = 0  # class-wide total, so a test sees reads from any instance

    def read(self, size: int = -1) -> bytes:
        data = super().read(size)
        CountingFile.count += len(data)
        return data

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def, override]
        n = super().readinto(buffer)
        CountingFile.count += n or 0
        return n


def write_with_gdal_mask(path: Path, image: np.ndarray, valid: np.ndarray,
                         **options: object) -> Path:
    """A GeoTIFF written by GDAL with an internal (per-dataset) mask band: 1-bit, deflate."""
    from rasterio.transform import from_origin

    c, h, w = image.shape
    with rasterio.Env(GDAL_TIFF_INTERNAL_MASK=True), rasterio.open(
            path, "w", driver="GTiff", width=w, height=h, count=c, dtype=image.dtype.name,
            crs="EPSG:32633", transform=from_origin(500000, 4000000, 10, 10),
            **options) as ds:
        ds.write(image)
        ds.write_mask(np.where(valid, 255, 0).astype(np.uint8))
    return path
