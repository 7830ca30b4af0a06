"""GeoTIFF tag carry-over: read the georeferencing tags of an input, write them to outputs.

A prediction mask must sit exactly on the image it was predicted from, so the writer copies
the GeoTIFF tags of the input page verbatim (``tifffile`` ``extratags`` form). ``GDAL_NODATA``
(42113) is not carried here: it is written from the writer's ``nodata`` argument, because a
mask has its own nodata value.

>>> tags = example_geotags(origin=(500000.0, 4500000.0), pixel_size=10.0)
>>> [code for code, *_ in tags.tags]
[33550, 33922, 34735, 34737]
>>> tags.to_extratags()[0]
(33550, 12, 3, (10.0, 10.0, 0.0), True)
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import tifffile

__all__ = ["GEOTIFF_TAG_CODES", "GDAL_NODATA_TAG", "GeoTags", "example_geotags", "open_dataset"]

#: ModelPixelScale, ModelTiepoint, ModelTransformation, GeoKeyDirectory,
#: GeoDoubleParams, GeoAsciiParams.
GEOTIFF_TAG_CODES: tuple[int, ...] = (33550, 33922, 34264, 34735, 34736, 34737)
#: GDAL's nodata tag: an ASCII number, e.g. ``"-9999"`` or ``"nan"``.
GDAL_NODATA_TAG = 42113

_ASCII = 2  # TIFF DATATYPE code of ASCII strings

TagTuple = tuple[int, int, int, Any]


def _normalise(value: Any) -> Any:
    """Make a tag value hashable and comparable: str, int, float or a tuple of numbers."""
    if isinstance(value, bytes):
        return value.decode("ascii", errors="replace")
    if isinstance(value, str | int | float):
        return value
    return tuple(v.item() if hasattr(v, "item") else v for v in value)


@dataclass(frozen=True)
class GeoTags:
    """The GeoTIFF tags of one TIFF page, ready to be written to another.

    Attributes:
        tags: ``(code, tifffile dtype code, count, value)`` per tag, sorted by code. ASCII
            values are ``str``; numeric values are tuples of Python numbers.

    """

    tags: tuple[TagTuple, ...] = ()

    @classmethod
    def from_page(cls, page: tifffile.TiffPage) -> GeoTags:
        """Collect the GeoTIFF tags of a ``tifffile`` page (empty if it has none).

        Args:
            page: e.g. ``tifffile.TiffFile(path).pages.first``.

        Returns:
            The tags listed in :data:`GEOTIFF_TAG_CODES` that the page has.

        """
        found = []
        for code in GEOTIFF_TAG_CODES:
            tag = page.tags.get(code)
            if tag is None:
                continue
            value = _normalise(tag.value)
            count = 0 if int(tag.dtype) == _ASCII else len(value) if isinstance(value, tuple) else 1
            found.append((code, int(tag.dtype), count, value))
        return cls(tuple(found))

    @classmethod
    def from_gdal(cls, dataset: Any) -> GeoTags:
        """The GeoTIFF tags GDAL writes for an open rasterio ``dataset``'s georeferencing.

        For a raster GDAL opens that is not a TIFF (a VRT, JPEG 2000, ...): its CRS and
        geotransform (rotated too), or its ground control points, are encoded by GDAL into
        a one-pixel GeoTIFF in memory, whose tags are read back (empty for an image with
        none of them).
        """
        gcps, gcp_crs = dataset.gcps
        if dataset.crs is None and dataset.transform.is_identity and not gcps:
            return cls()
        import io
        import warnings

        from rasterio.errors import NotGeoreferencedWarning
        from rasterio.io import MemoryFile

        with MemoryFile() as mem:
            if gcps:
                with warnings.catch_warnings():  # not georeferenced until the points are set
                    warnings.simplefilter("ignore", NotGeoreferencedWarning)
                    out = mem.open(driver="GTiff", width=1, height=1, count=1, dtype="uint8")
                with out:
                    out.gcps = (gcps, gcp_crs)
            else:
                with mem.open(driver="GTiff", width=1, height=1, count=1, dtype="uint8",
                              crs=dataset.crs, transform=dataset.transform):
                    pass
            data = bytes(mem.getbuffer())
        with tifffile.TiffFile(io.BytesIO(data)) as tif:
            page = tif.pages.first
            assert isinstance(page, tifffile.TiffPage)
            return cls.from_page(page)

    @property
    def is_empty(self) -> bool:
        """True when there are no GeoTIFF tags (the input was a plain TIFF)."""
        return not self.tags

    def to_extratags(self) -> list[tuple[int, int, int, Any, bool]]:
        """Return the tags in ``tifffile.TiffWriter.write(extratags=...)`` form.

        Returns:
            ``(code, dtype, count, value, writeonce)`` tuples; ASCII tags have count 0 so
            ``tifffile`` counts the bytes (and the terminating NUL) itself.

        """
        return [(code, dtype, count, value, True) for code, dtype, count, value in self.tags]


def _geokey_directory(epsg: int) -> tuple[int, ...]:
    """Build a GeoKeyDirectory for a projected CRS given by EPSG code, pixel-is-area, metres."""
    keys = [
        (1024, 0, 1, 1),  # GTModelTypeGeoKey = ModelTypeProjected
        (1025, 0, 1, 1),  # GTRasterTypeGeoKey = RasterPixelIsArea
        (1026, 34737, 0, 0),  # GTCitationGeoKey -> GeoAsciiParams (count patched below)
        (3072, 0, 1, epsg),  # ProjectedCSTypeGeoKey
        (3076, 0, 1, 9001),  # ProjLinearUnitsGeoKey = metre
    ]
    header = (1, 1, 0, len(keys))
    return header + tuple(v for key in keys for v in key)


def _citation(epsg: int) -> str:
    """Name the CRS for humans, for for GeoAsciiParams ('|' terminates each entry)."""
    if 32601 <= epsg <= 32660:
        return f"WGS 84 / UTM zone {epsg - 32600}N|"
    if 32701 <= epsg <= 32760:
        return f"WGS 84 / UTM zone {epsg - 32700}S|"
    return f"EPSG:{epsg}|"


def example_geotags(origin: tuple[float, float] = (500000.0, 4500000.0), pixel_size: float = 1.0,
                    epsg: int = 32633) -> GeoTags:
    """Build a valid north-up GeoTIFF header (used by tests and the synthetic data generator).

    Args:
        origin: ``(x, y)`` map coordinates of the top-left corner of the top-left pixel.
        pixel_size: ground sampling distance in CRS units (metres for UTM).
        epsg: EPSG code of a projected CRS; the default is WGS 84 / UTM zone 33N.

    Returns:
        ModelPixelScale, ModelTiepoint, GeoKeyDirectory and GeoAsciiParams tags.

    """
    citation = _citation(epsg)
    keys = list(_geokey_directory(epsg))
    keys[4 + 4 * 2 + 2] = len(citation)  # GTCitationGeoKey count: characters incl. '|'
    x0, y0 = float(origin[0]), float(origin[1])
    size = float(pixel_size)
    return GeoTags((
        (33550, 12, 3, (size, size, 0.0)),
        (33922, 12, 6, (0.0, 0.0, 0.0, x0, y0, 0.0)),
        (34735, 3, len(keys), tuple(keys)),
        (34737, _ASCII, 0, citation),
    ))


def open_dataset(path: str | os.PathLike[str], mode: str = "r", **kwargs: Any) -> Any:
    """``rasterio.open(path, mode)`` without rasterio's ``NotGeoreferencedWarning``.

    An image without georeferencing (a microscope's, a detector plane, a street scene) is an
    ordinary input here: its outputs are written in pixel coordinates, with nothing to warn
    about. Every dataset the project opens through rasterio is opened by this function.
    """
    import rasterio
    from rasterio.errors import NotGeoreferencedWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGeoreferencedWarning)
        return rasterio.open(path, mode, **kwargs)
