"""Read a prediction store's labels like a raster file (windows of ``[C, h, w]``).

>>> with open_raster("scene_mask.zarr") as r:  # doctest: +SKIP
...     r.read(Window(0, 0, 256, 256)).shape
(1, 256, 256)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import numpy as np
import zarr

from seg_at_scale.errors import InputError
from seg_at_scale.io.raster import RasterReader
from seg_at_scale.tiling.geometry import Window

__all__ = ["ZarrRaster", "open_raster"]


class ZarrRaster:
    """Windowed reads of one array (``labels`` by default) of a Zarr group."""

    bands: int
    height: int
    width: int

    def __init__(self, path: str | os.PathLike[str], array: str = "labels") -> None:
        self.path = Path(path)
        try:
            self._array = cast(zarr.Array, zarr.open_group(self.path, mode="r")[array])
        except (FileNotFoundError, KeyError, ValueError) as exc:
            raise InputError(f"cannot read '{self.path}' as a prediction store: {exc}") from exc
        shape = self._array.shape
        self.bands, self.height, self.width = (1, *shape) if len(shape) == 2 else shape
        self.dtype = np.dtype(str(self._array.dtype))
        self.nodata = self._array.attrs.get("_FillValue")

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.bands, self.height, self.width)

    def read(self, window: Window, **_: Any) -> np.ndarray:
        """``[C, h, w]`` of a window inside the array."""
        if window.row < 0 or window.col < 0 or window.row_end > self.height \
                or window.col_end > self.width:
            raise InputError(f"{window} reaches outside '{self.path}' "
                             f"({self.height}x{self.width})")
        data = cast(np.ndarray,  # a slice of a numpy-backed array
                    self._array[..., window.row : window.row_end, window.col : window.col_end])
        return data[None] if data.ndim == 2 else data

    def close(self) -> None:
        """Nothing to release (zarr opens chunk files per read)."""

    def __enter__(self) -> ZarrRaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_raster(path: str | os.PathLike[str]) -> RasterReader | ZarrRaster:
    """A windowed reader of a TIFF or of a prediction store's labels (``.zarr``)."""
    return ZarrRaster(path) if Path(path).suffix.lower() == ".zarr" else RasterReader(path)
