"""Vector outputs: seamless polygons of a label raster, streamed strip by strip."""

from seg_at_scale.vectors.polygonize import MergeStats, Region, polygonize
from seg_at_scale.vectors.sources import georeference
from seg_at_scale.vectors.write import FORMATS, VectorStats, write_vectors

__all__ = ["FORMATS", "MergeStats", "Region", "VectorStats", "georeference", "polygonize",
           "write_vectors"]
