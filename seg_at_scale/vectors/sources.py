"""What the polygonizer reads: label and probability rasters in row bands, and the georeference.

A source is a ``.zarr`` prediction store, a (Geo)TIFF, or an in-memory array. All three
answer ``read(Window) -> [C, h, w]`` (:func:`seg_at_scale.io.zarr_raster.open_raster` for
files, :class:`ArrayRaster` for arrays), so the polygonizer never holds more than a band.

>>> labels = ArrayRaster(np.zeros((203, 171), np.uint8))
>>> [(row, band[0].shape) for row, (band,) in row_bands([labels], 90)]
[(0, (90, 171)), (90, (90, 171)), (180, (23, 171))]
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import zarr
from affine import Affine
from rasterio.crs import CRS

from seg_at_scale.errors import InputError
from seg_at_scale.io.geotags import open_dataset
from seg_at_scale.io.raster import RasterReader
from seg_at_scale.io.zarr_raster import ZarrRaster, open_raster
from seg_at_scale.tiling.geometry import Window

__all__ = [
    "ArrayRaster",
    "BandReader",
    "NODATA",
    "STRIP_PIXELS",
    "georeference",
    "closed_on_error",
    "open_labels",
    "open_probabilities",
    "block_rows",
    "probability_scale",
    "reader_path",
    "row_bands",
    "store_class_names",
]

log = logging.getLogger(__name__)

#: Label value that is never polygonized (the prediction store's fill value).
NODATA = 255
#: Pixels per strip when ``strip_rows`` is not given: a few tens of MiB of working arrays.
STRIP_PIXELS = 1 << 22

Source = str | os.PathLike[str] | np.ndarray


class BandReader(Protocol):
    """Anything read in windows: a TIFF, a store's array or an :class:`ArrayRaster`."""

    height: int
    width: int
    bands: int
    dtype: np.dtype

    def read(self, window: Window) -> np.ndarray: ...

    def close(self) -> None: ...


class ArrayRaster:
    """An in-memory ``[C, H, W]`` or ``[H, W]`` array read in windows like a raster file."""

    def __init__(self, array: np.ndarray, name: str = "array") -> None:
        arr = np.asarray(array)
        self.array = arr[None] if arr.ndim == 2 else arr
        if self.array.ndim != 3:
            raise InputError(f"{name} has shape {arr.shape}; pass [H, W] labels or "
                             "[K, H, W] probabilities")
        self.path = name
        self.bands, self.height, self.width = self.array.shape
        self.dtype = self.array.dtype

    def read(self, window: Window) -> np.ndarray:
        """``[C, h, w]`` view of a window."""
        return self.array[:, window.row : window.row_end, window.col : window.col_end]

    def close(self) -> None:
        """Nothing to release."""


def _open(source: Source, array: str, name: str) -> BandReader:
    if isinstance(source, np.ndarray):
        return ArrayRaster(source, name)
    if Path(source).suffix.lower() == ".zarr":
        reader = ZarrRaster(source, array=array)
        _check_complete(Path(source))
        return reader
    return open_raster(source)


def _check_complete(path: Path) -> None:
    """Refuse a prediction store whose run has not finished.

    Its missing tiles would read as no data and silently become holes in the polygons.
    """
    attrs = zarr.open_group(path, mode="r").attrs
    if "complete" in attrs and not attrs["complete"]:
        raise InputError(f"'{path}' is an unfinished prediction (complete=false); rerun the "
                         "prediction to finish it, then polygonize")


def open_labels(labels: Source) -> BandReader:
    """A reader of a label raster: one uint8 band of class ids, 255 = no data.

    Raises:
        InputError: the file cannot be read, has several bands, or is not uint8.
    """
    reader = _open(labels, "labels", "labels")
    with closed_on_error(reader):
        if reader.bands != 1 or reader.dtype != np.uint8:
            raise InputError(f"labels '{reader_path(reader)}' has {reader.bands} band(s) of "
                             f"{reader.dtype}; a label raster is one uint8 band of class ids "
                             "(255 = no data): pass the prediction's mask or .zarr store")
    return reader


def open_probabilities(probabilities: Source, labels: BandReader) -> BandReader:
    """A reader of ``[K, H, W]`` class probabilities matching ``labels``.

    ``probabilities`` is a store (its ``probabilities`` array), a ``*_probabilities.tif``
    or an array; uint8 (round(255 p)) or floating point.

    Raises:
        InputError: missing array, other size than the labels, or an integer type
            other than uint8.
    """
    reader = _open(probabilities, "probabilities", "probabilities")
    where = reader_path(reader)
    with closed_on_error(reader):
        if (reader.height, reader.width) != (labels.height, labels.width):
            raise InputError(f"probabilities '{where}' are {reader.height}x{reader.width} but "
                             f"the labels are {labels.height}x{labels.width}; pass the "
                             "probabilities of the same prediction")
        probability_scale(reader.dtype, where)
    return reader


@contextmanager
def closed_on_error(*readers: BandReader) -> Iterator[None]:
    """Close ``readers`` (their open files) when the block raises, then re-raise."""
    try:
        yield
    except BaseException:
        for reader in readers:
            reader.close()
        raise


def probability_scale(dtype: np.dtype, where: str = "probabilities") -> float:
    """What one stored unit is worth: 1/255 for uint8 (round(255 p)), 1 for floats.

    Raises:
        InputError: ``dtype`` is neither uint8 nor floating point.
    """
    if dtype == np.uint8:
        return 1 / 255
    if np.issubdtype(dtype, np.floating):
        return 1.0
    raise InputError(f"probabilities '{where}' are {dtype}; expected uint8 (round(255 p)) "
                     "or float16/float32")


def reader_path(reader: BandReader) -> str:
    """The file (or array name) a reader reads, for messages."""
    return str(getattr(reader, "path", "array"))


BLOCK_STRIPS = 4  # a storage block up to this many strips tall is read whole


def block_rows(reader: BandReader) -> int:
    """Rows of one storage block (TIFF tile or strip, zarr chunk); 1 for arrays.

    Reads aligned to it decode every block once.
    """
    if isinstance(reader, RasterReader):
        return int(reader.layout.seg[0])
    if isinstance(reader, ZarrRaster):
        return int(reader._array.chunks[-2])  # noqa: SLF001 - the reader owns no chunk API
    return 1


def row_bands(readers: Sequence[BandReader], strip_rows: int | None = None
              ) -> Iterator[tuple[int, list[np.ndarray]]]:
    """The rasters top to bottom in strips of ``strip_rows`` rows (all of the same rows).

    Files are read in bands of whole storage blocks (of the first reader) and cut into
    strips, so no block is decoded twice; a block taller than ``BLOCK_STRIPS`` strips (a
    single-strip TIFF holds the whole raster in one) is read strip by strip instead, so
    memory stays at a strip.

    Args:
        readers: rasters of one size; the first decides the block alignment.
        strip_rows: rows per strip; default ``STRIP_PIXELS // width`` (at least 1).

    Yields:
        ``(first row, [strip [C, h, W] of each reader])``.
    """
    first = readers[0]
    rows = strip_rows or max(1, STRIP_PIXELS // first.width)
    block = max(1, block_rows(first))
    band_rows = math.ceil(rows / block) * block if block <= BLOCK_STRIPS * rows else rows
    for top in range(0, first.height, band_rows):
        window = Window(top, 0, min(band_rows, first.height - top), first.width)
        bands = [r.read(window) for r in readers]
        for r0 in range(0, window.height, rows):
            yield top + r0, [b[:, r0 : r0 + rows] for b in bands]


def georeference(source: str | os.PathLike[str]) -> tuple[Affine, CRS | None]:
    """The pixel-to-map transform and CRS of a TIFF or a prediction store.

    A store keeps them in its attributes (``geotransform`` in GDAL order, ``crs_wkt``);
    a TIFF is asked through rasterio. An image without georeference gives the identity
    (map coordinates = pixel coordinates, y down) and no CRS.

    >>> georeference("scene_mask.zarr")  # doctest: +SKIP
    (Affine(10.0, 0.0, 500000.0, 0.0, -10.0, 4500000.0), CRS.from_epsg(32633))
    """
    path = Path(source)
    if path.suffix.lower() == ".zarr":
        try:
            attrs: dict[str, Any] = dict(zarr.open_group(path, mode="r").attrs)
        except (FileNotFoundError, ValueError) as exc:
            raise InputError(f"cannot read '{path}' as a prediction store: {exc}") from exc
        gt, wkt = attrs.get("geotransform"), attrs.get("crs_wkt")
        return (Affine.from_gdal(*gt) if gt else Affine.identity(),
                CRS.from_wkt(wkt) if wkt else None)
    from rasterio.errors import RasterioIOError

    try:
        with open_dataset(path) as ds:
            points = ds.gcps[0]
            if points and ds.transform.is_identity and ds.crs is None:
                log.warning("'%s' is georeferenced by %d ground control points, which "
                            "polygons do not follow: they are in pixel coordinates; warp the "
                            "image first (gdalwarp) to have them in its CRS", path, len(points))
            return ds.transform, ds.crs
    except RasterioIOError as exc:
        raise InputError(f"cannot read the georeference of '{path}': {exc}") from exc


def store_class_names(source: Source) -> list[str] | None:
    """The class names a prediction store records (None for other sources)."""
    if isinstance(source, np.ndarray) or Path(source).suffix.lower() != ".zarr":
        return None
    names = zarr.open_group(Path(source), mode="r").attrs.get("class_names")
    return list(cast(list[str], names)) if names else None  # written as a list of str
