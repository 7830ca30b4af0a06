"""Helpers for tests/io/test_io.py: synthetic arrays and a byte-counting file."""

from __future__ import annotations

import io

import numpy as np


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
