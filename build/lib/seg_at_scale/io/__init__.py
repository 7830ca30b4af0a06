"""Raster I/O: windowed TIFF reading, streaming atomic writing, GeoTIFF tags, previews."""

from seg_at_scale.io.geotags import GeoTags, example_geotags
from seg_at_scale.io.preview import read_overview, write_preview_png
from seg_at_scale.io.raster import RasterReader, read_raster
from seg_at_scale.io.writer import check_output_path, write_raster, write_raster_bands

__all__ = [
    "GeoTags",
    "RasterReader",
    "check_output_path",
    "example_geotags",
    "read_overview",
    "read_raster",
    "write_preview_png",
    "write_raster",
    "write_raster_bands",
]
