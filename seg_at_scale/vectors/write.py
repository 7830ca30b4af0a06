"""Write the polygons of a label raster as GeoPackage, GeoParquet or FlatGeobuf, streamed.

>>> stats = write_vectors("scene_mask.zarr", "scene.gpkg",  # doctest: +SKIP
...                       class_names=["background", "vegetation", "water", "road", "building"],
...                       connectivity=8, min_area=100.0)
>>> stats.features  # doctest: +SKIP
{'background': 812, 'vegetation': 1530, 'water': 77, 'road': 41, 'building': 9120}

Regions come from :func:`~seg_at_scale.vectors.polygonize.polygonize` as they close and go
to the file in batches (Arrow record batches through ``pyogrio.write_arrow`` for GPKG and
FlatGeobuf, ``pyarrow.parquet.ParquetWriter`` for GeoParquet, which this GDAL build lacks),
so memory stays at one strip, the open regions and one batch. Coordinates are pixel
integers until here; the affine transform is applied once per batch.

``simplify`` uses ``shapely.coverage_simplify`` (:mod:`seg_at_scale.vectors.simplify`):
neighbouring polygons keep one shared edge, so no gaps or overlaps open between classes
(per-polygon ``simplify`` would open slivers between every pair of neighbours). It needs
every polygon at once, so with ``simplify > 0`` memory grows with the vertices of the whole
output; ``simplify=0`` streams.

The file is written under a hidden temporary name beside ``output`` and renamed onto it when
complete: a killed run leaves nothing under the final name (its temporary is removed by the
next run), and rerunning the same call writes the whole file.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import shapely
from affine import Affine
from rasterio.crs import CRS

from seg_at_scale.errors import ConfigError, InputError
from seg_at_scale.io.writer import check_output_path, remove_stale_temporaries, temporary_path
from seg_at_scale.vectors.polygonize import MergeStats, Region, check_options, polygonize
from seg_at_scale.vectors.simplify import coverage_simplified
from seg_at_scale.vectors.sources import Source, georeference, store_class_names

if TYPE_CHECKING:  # imported where a file is written: every command imports this module
    import pyarrow as pa

__all__ = ["FORMATS", "VectorStats", "write_vectors", "vector_format", "to_map", "layer_name"]

#: Output extension -> (GDAL driver, what it is).
FORMATS: dict[str, tuple[str, str]] = {
    ".gpkg": ("GPKG", "GeoPackage"),
    ".parquet": ("Parquet", "GeoParquet"),
    ".fgb": ("FlatGeobuf", "FlatGeobuf"),
}
BATCH = 4096  # features per Arrow batch


@dataclass
class VectorStats:
    """What :func:`write_vectors` wrote.

    Attributes:
        path: the output file.
        features: features written per class name.
        dropped: regions smaller than ``min_area``.
        seconds: wall time.
        strips: strips read.
        peak_open_regions: most regions held open at a seam at once.
        peak_open_pieces: most polygon pieces held for them (the memory bound).
    """

    path: Path
    features: dict[str, int] = field(default_factory=dict)
    dropped: int = 0
    seconds: float = 0.0
    strips: int = 0
    peak_open_regions: int = 0
    peak_open_pieces: int = 0


def vector_format(output: str | os.PathLike[str], key: str = "output") -> str:
    """The GDAL driver for ``output``'s extension.

    Raises:
        ConfigError: the extension is not one of :data:`FORMATS`.
    """
    suffix = Path(output).suffix.lower()
    if suffix not in FORMATS:
        choices = ", ".join(f"{ext} ({name})" for ext, (_, name) in FORMATS.items())
        bare = str(output).lower().lstrip(".")
        named = (f" (a file name: {key}=<name>.{bare}; the format alone is for images=)"
                 if not suffix and f".{bare}" in FORMATS else "")
        raise ConfigError(f"{key} '{output}': unknown vector extension '{suffix}'{named}; use "
                          f"{choices}")
    return FORMATS[suffix][0]


def to_map(geometries: np.ndarray, transform: Affine) -> np.ndarray:
    """Pixel coordinates to map coordinates, ``[N]`` geometries in and out.

    Uses GDAL's order of operations (``c + x a + y b``), so integer pixel corners land on
    the same floats as in ``rasterio.features.shapes``.
    """
    if transform.is_identity:
        return geometries
    a, b, c, d, e, f = transform[:6]

    def apply(xy: np.ndarray) -> np.ndarray:
        x, y = xy[:, 0], xy[:, 1]
        return np.column_stack([c + x * a + y * b, f + x * d + y * e])

    return shapely.transform(geometries, apply)


def write_vectors(labels: Source, output: str | os.PathLike[str], *,
                  class_names: Sequence[str] | None = None, connectivity: int = 4,
                  min_area: float = 0.0, simplify: float = 0.0,
                  classes: Iterable[int] | None = None, probabilities: Source | None = None,
                  overwrite: bool = False, strip_rows: int | None = None,
                  transform: Affine | None = None, crs: CRS | None = None,
                  key: str = "output") -> VectorStats:
    """Polygonize a label raster into a vector file, one feature per connected region.

    Args:
        labels: ``.zarr`` prediction store, label TIFF, or ``[H, W]`` uint8 array.
        output: ``.gpkg``, ``.parquet`` (GeoParquet) or ``.fgb``; layer = file stem
            (:func:`layer_name`).
        class_names: name of each class id (default: the store's, else ``class_<id>``).
        connectivity: 4 or 8 (8 joins regions touching at a corner: MultiPolygons).
        min_area: drop regions smaller than this, in CRS units (m² for UTM).
        simplify: coverage-simplification tolerance in CRS units (0: exact pixel edges).
        classes: polygonize only these class ids.
        probabilities: add ``mean_probability`` from this ``[K, H, W]`` raster or array.
        overwrite: replace an existing ``output``.
        strip_rows: rows per strip (default about 4 Mpx per strip).
        transform: pixel-to-map transform for array input (files carry their own).
        crs: CRS for array input.
        key: the option name used in error messages (e.g. ``vector``).

    Returns:
        Counts, timing and the streaming peaks.

    Raises:
        ConfigError: bad extension or option. OutputExistsError: ``output`` exists.
        InputError: unreadable inputs.
    """
    t0 = time.perf_counter()
    out = Path(output)
    driver = vector_format(out, key)
    check_output_path(out, overwrite, key=key)
    kept = check_options(connectivity, classes, strip_rows)
    _check_amounts(min_area=min_area, simplify=simplify)
    if not isinstance(labels, np.ndarray):
        transform, crs = georeference(labels)
    transform = transform or Affine.identity()
    names = list(class_names or store_class_names(labels) or [])
    stats = VectorStats(out)
    merge = MergeStats()
    regions = polygonize(labels, connectivity=connectivity, classes=kept,
                         probabilities=probabilities, strip_rows=strip_rows, stats=merge)
    layout = _Layout(names, transform, connectivity, probabilities is not None, min_area)
    batches = layout.batches(regions, stats, simplify)
    remove_stale_temporaries(out)
    tmp = temporary_path(out).with_suffix(out.suffix)
    try:
        _write(batches, tmp, driver, layer_name(out.stem, driver), layout, crs)
        os.replace(tmp, out)
    finally:
        _remove(tmp)
    stats.strips, stats.seconds = merge.strips, time.perf_counter() - t0
    stats.peak_open_regions, stats.peak_open_pieces = merge.peak_open_regions, \
        merge.peak_open_pieces
    return stats


def _check_amounts(**values: float) -> None:
    for name, value in values.items():
        if not isinstance(value, int | float) or not value >= 0:
            raise ConfigError(f"{name}={value!r}: use a number >= 0 (CRS units; 0 = off)")


@dataclass
class _Layout:
    """The layer's columns and how regions become rows of them."""

    names: list[str]
    transform: Affine
    connectivity: int
    with_probability: bool
    min_area: float

    @property
    def geometry_type(self) -> str:
        return "Polygon" if self.connectivity == 4 else "MultiPolygon"

    @property
    def schema(self) -> pa.Schema:
        import pyarrow as pa

        fields = [("class_id", pa.int32()), ("class_name", pa.string()),
                  ("area", pa.float64()), ("pixels", pa.int64())]
        if self.with_probability:
            fields.append(("mean_probability", pa.float64()))
        return pa.schema([*fields, ("geometry", pa.binary())])

    def name(self, class_id: int) -> str:
        if not self.names:
            return f"class_{class_id}"
        if class_id >= len(self.names):
            raise InputError(f"labels hold class {class_id} but class_names lists "
                             f"{len(self.names)} names; pass a name for every class")
        return self.names[class_id]

    def batches(self, regions: Iterable[Region], stats: VectorStats, simplify: float
                ) -> Iterator[pa.RecordBatch]:
        """Record batches of the kept regions (all at once when simplifying)."""
        kept = self.large_enough(regions, stats)
        if simplify > 0:
            kept = iter(self.simplified(list(kept), simplify))
        batch: list[Region] = []
        for region in kept:
            batch.append(region)
            if len(batch) == BATCH:
                yield self.record_batch(batch, stats)
                batch = []
        if batch:
            yield self.record_batch(batch, stats)

    def simplified(self, regions: list[Region], tolerance: float) -> list[Region]:
        """All regions coverage-simplified together (see the module docstring).

        Done in pixel coordinates: Visvalingam-Whyatt removes triangles by area, and an
        affine transform scales every area by ``|det|``, so ``tolerance / sqrt(|det|)``
        pixels removes what ``tolerance`` would in map units.
        """
        geoms = np.array([r.geometry for r in regions], dtype=object)
        pixels = tolerance / abs(self.transform.determinant) ** 0.5
        return [Region(r.class_id, g, r.pixels, r.probability)
                for r, g in zip(regions, coverage_simplified(geoms, pixels))]

    def large_enough(self, regions: Iterable[Region], stats: VectorStats) -> Iterator[Region]:
        """The regions of at least ``min_area`` (the others are counted as dropped)."""
        pixel_area = abs(self.transform.determinant)
        for region in regions:
            if region.pixels * pixel_area >= self.min_area:
                yield region
            else:
                stats.dropped += 1

    def record_batch(self, regions: list[Region], stats: VectorStats) -> pa.RecordBatch:
        import pyarrow as pa

        ids = np.array([r.class_id for r in regions], np.int32)
        names = [self.name(int(c)) for c in ids]
        for name in names:
            stats.features[name] = stats.features.get(name, 0) + 1
        pixels = np.array([r.pixels for r in regions], np.int64)
        geoms = to_map(np.array([r.geometry for r in regions], dtype=object), self.transform)
        if self.connectivity == 8:
            parts, index = shapely.get_parts(geoms, return_index=True)
            geoms = shapely.multipolygons(parts, indices=index)
        columns = [pa.array(ids), pa.array(names, pa.string()),
                   pa.array(pixels * abs(self.transform.determinant)), pa.array(pixels)]
        if self.with_probability:
            columns.append(pa.array([r.probability for r in regions], pa.float64()))
        columns.append(pa.array(shapely.to_wkb(geoms), pa.binary()))
        return pa.record_batch(columns, schema=self.schema)


def layer_name(stem: str, driver: str) -> str:
    """The layer of a vector file: its stem, or ``layer_<stem>`` where GeoPackage reserves it.

    GDAL's GeoPackage driver refuses a layer named from ``-``, ``+``, ``#`` (any character
    that is not a letter, digit or ``_``), or from ``gpkg`` or ``sqlite_`` (its own tables).

    >>> layer_name("-dash", "GPKG"), layer_name("gpkg_x", "GPKG"), layer_name("scene", "GPKG")
    ('layer_-dash', 'layer_gpkg_x', 'scene')
    """
    first = stem[:1]
    if driver == "GPKG" and (not (first.isalnum() or first == "_")
                             or stem.startswith("gpkg") or stem.lower().startswith("sqlite_")):
        return f"layer_{stem}"
    return stem


def _write(batches: Iterator[pa.RecordBatch], path: Path, driver: str, layer: str,
           layout: _Layout, crs: CRS | None) -> None:
    import pyarrow as pa

    source = _Source(batches)
    reader = pa.RecordBatchReader.from_batches(layout.schema, iter(source))
    try:
        if driver == "Parquet":
            _write_geoparquet(reader, path, layout, crs)
            return
        import pyogrio

        with warnings.catch_warnings():
            # an image without a CRS gives polygons in pixel coordinates, as it should
            warnings.filterwarnings("ignore", "'crs' was not provided", UserWarning)
            pyogrio.write_arrow(reader, path, layer=layer, driver=driver,
                                geometry_name="geometry", geometry_type=layout.geometry_type,
                                crs=crs.to_wkt() if crs else None)
    except Exception:
        if source.error is not None:  # GDAL reports "Error while accessing batch": say why
            raise source.error from None
        raise


class _Source:
    """The batches, keeping the exception that stopped them (the Arrow C stream hides it)."""

    def __init__(self, batches: Iterator[pa.RecordBatch]) -> None:
        self.batches = batches
        self.error: Exception | None = None

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        try:
            yield from self.batches
        except Exception as exc:
            self.error = exc
            raise


def _write_geoparquet(reader: pa.RecordBatchReader, path: Path, layout: _Layout,
                      crs: CRS | None) -> None:
    """Parquet row groups from the batches, then GeoParquet's ``geo`` metadata (spec 1.1)."""
    import pyarrow.parquet as pq
    import pyproj

    bounds = np.array([np.inf, np.inf, -np.inf, -np.inf])
    with pq.ParquetWriter(path, reader.schema, compression="zstd") as writer:
        for batch in reader:
            box = shapely.total_bounds(shapely.from_wkb(batch.column("geometry")))
            bounds = np.concatenate([np.fmin(bounds[:2], box[:2]), np.fmax(bounds[2:], box[2:])])
            writer.write_batch(batch)
        column = {"encoding": "WKB", "geometry_types": [layout.geometry_type],
                  "crs": pyproj.CRS.from_wkt(crs.to_wkt()).to_json_dict() if crs else None}
        if np.isfinite(bounds).all():
            column["bbox"] = bounds.tolist()
        writer.add_key_value_metadata({"geo": json.dumps(
            {"version": "1.1.0", "primary_column": "geometry", "columns": {"geometry": column}})})


def _remove(path: Path) -> None:
    """A temporary output and SQLite's journal files beside it."""
    for p in (path, *(path.with_name(path.name + s) for s in ("-journal", "-wal", "-shm"))):
        with suppress(OSError):
            p.unlink()
