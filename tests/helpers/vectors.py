"""Helpers for tests/vectors: label rasters with hard shapes, the whole-array reference,
pairing of polygons, and inputs in the project's real formats (zarr store, GeoTIFF)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import rasterio.features
import shapely
from affine import Affine
from shapely.geometry import shape

from seg_at_scale.io import example_geotags, write_raster
from seg_at_scale.prediction.store import PredictionStore
from seg_at_scale.tiling.geometry import Footprint, make_grid

NAMES = ["background", "vegetation", "water", "road", "building"]
#: example_geotags(): UTM 33N, origin (500000, 4500000), 1 m pixels, north up.
GEO = Affine(1.0, 0.0, 500000.0, 0.0, -1.0, 4500000.0)
PIXELS = Affine.identity()


def _ring(lab: np.ndarray, r: int, c: int, outer: int, width: int, value: int) -> None:
    """A square ring of ``value``: side ``2*outer``, ``width`` pixels thick."""
    lab[r - outer : r + outer, c - outer : c + outer] = value
    inner = outer - width
    if inner > 0:
        lab[r - inner : r + inner, c - inner : c + inner] = 0


def make_labels(height: int, width: int, seed: int = 0) -> np.ndarray:
    """``[H, W]`` uint8 labels (classes 0..4, 255 no data) whose regions cross many seams.

    Nested rings (holes inside holes, islands inside holes), a U and an inverted U (arms
    that join only below / above), a diagonal staircase and a checkerboard (4- vs
    8-connectivity differ), stripes on all four borders, no-data blocks and noise pixels.
    """
    rng = np.random.default_rng(seed)
    lab = np.zeros((height, width), np.uint8)
    cy, cx = height // 2, width // 3
    for k, value in enumerate((1, 2, 1, 2, 3)):  # nested rings: hole in hole in hole ...
        _ring(lab, cy, cx, max(2, min(height, width) // 3 - 9 * k), 3, value)
        if k == 4:
            lab[cy, cx] = 4  # an island in the innermost hole
    ux = min(width - 24, 2 * width // 3)
    lab[10 : height - 10, ux : ux + 3] = 3  # U: two arms joined at the bottom
    lab[10 : height - 10, ux + 12 : ux + 15] = 3
    lab[height - 13 : height - 10, ux : ux + 15] = 3
    lab[5:8, ux - 10 : ux + 25] = 2  # inverted U: joined at the top
    lab[5 : height - 20, ux - 10 : ux - 7] = 2
    lab[5 : height - 20, ux + 22 : ux + 25] = 2
    for i in range(min(height, width) // 2):  # diagonal staircase: one region only with 8
        lab[i, i // 2 + 2] = 4
    board = (np.add.outer(np.arange(12), np.arange(12)) % 2).astype(np.uint8)
    lab[height - 30 : height - 18, 2:14] = 1 + 2 * board  # checkerboard of 1 and 3
    lab[0, :] = 1  # borders
    lab[-1, width // 4 :] = 2
    lab[:, 0] = 3
    lab[height // 3 :, -1] = 4
    lab[20:27, width // 2 : width // 2 + 9] = 255  # no data
    noise = rng.random((height, width)) < 0.02
    lab[noise] = rng.choice(np.array([0, 1, 2, 3, 4, 255], np.uint8), int(noise.sum()))
    return lab


def reference(labels: np.ndarray, connectivity: int, transform: Affine = PIXELS
              ) -> list[tuple[int, shapely.Geometry]]:
    """The whole array at once with ``rasterio.features.shapes`` (made valid for shapely)."""
    return [(int(v), shapely.make_valid(shape(g))) for g, v in rasterio.features.shapes(
        labels, mask=labels != 255, connectivity=connectivity, transform=transform)]


def assert_same_regions(expected: list[tuple[int, shapely.Geometry]],
                        got: list[tuple[int, shapely.Geometry]], tolerance: float = 0.0
                        ) -> None:
    """Same count per class, and each expected polygon equals exactly one of ``got``
    (symmetric-difference area <= ``tolerance``; 0 on pixel coordinates)."""
    count = lambda rs: np.bincount([c for c, _ in rs], minlength=256)  # noqa: E731
    assert (count(expected) == count(got)).all(), "different number of regions per class"
    for cls in {c for c, _ in expected}:
        want = np.array([g for c, g in expected if c == cls], dtype=object)
        have = np.array([g for c, g in got if c == cls], dtype=object)
        i, j = shapely.STRtree(have).query(shapely.point_on_surface(want),
                                          predicate="intersects")
        diff = shapely.area(shapely.symmetric_difference(want[i], have[j]))
        equal = diff <= tolerance
        matched = np.bincount(i[equal], minlength=len(want))
        assert (matched == 1).all(), (
            f"class {cls}: {int((matched != 1).sum())} of {len(want)} polygons unmatched, "
            f"e.g. {want[np.argmax(matched != 1)].wkt[:200]}")
        assert len(set(j[equal].tolist())) == len(want)  # one-to-one


def probabilities(labels: np.ndarray, classes: int = 5, seed: int = 1) -> np.ndarray:
    """``[K, H, W]`` uint8 probabilities (random, for the mean attribute)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (classes, *labels.shape), dtype=np.uint8)


def write_store(path: Path, labels: np.ndarray, probs: np.ndarray | None = None,
                tile: int = 128) -> Path:
    """A finished prediction store as ``predict_raster`` leaves it (georeferenced)."""
    h, w = labels.shape
    grid = make_grid(h, w, Footprint(0, 1, "same"), tile_size=tile, uniform=True)
    from rasterio.crs import CRS

    attrs = {"class_names": NAMES, "nodata": 255, "source": "scene.tif",
             "geotransform": list(GEO.to_gdal()), "crs_wkt": CRS.from_epsg(32633).to_wkt()}
    store = PredictionStore.open(path, grid, fingerprint={"test": 1}, num_classes=5,
                                 probabilities=None if probs is None else str(probs.dtype),
                                 attrs=attrs, resume=False)
    for t in grid.tiles:
        rows, cols = t.core.slices()
        store.write(t, labels[rows, cols], None if probs is None else probs[:, rows, cols])
    store.finish(np.bincount(labels.ravel(), minlength=256)[:5].tolist())
    return path


def write_tiff(path: Path, array: np.ndarray) -> Path:
    """A tiled GeoTIFF (``example_geotags()``: EPSG:32633, 1 m pixels) in the project's way."""
    return write_raster(path, array, tile=(64, 64), geotags=example_geotags())


def checkerboard_labels(height: int, width: int, nodata: bool = False) -> np.ndarray:
    """``[H, W]`` a pixel checkerboard: class 0 on one colour, classes 1..3 in blocks on
    the other (with 8-connectivity class 0 is one region of squares joined only at
    corners, and each block of class 1..3 a smaller one)."""
    r, c = np.indices((height, width))
    lab = np.where((r + c) % 2, 1 + (r // 3 + c // 4) % 3, 0).astype(np.uint8)
    if nodata:
        lab[(r * 7 + c * 3) % 29 == 0] = 255
    return lab


def noise_labels(height: int, width: int, seed: int = 0, fraction: float = 0.5,
                 nodata: bool = False) -> np.ndarray:
    """``[H, W]`` blocks of classes 0..4 with ``fraction`` of the pixels a random class."""
    rng = np.random.default_rng(seed)
    r, c = np.indices((height, width))
    lab = ((r // 9 + c // 13) % 5).astype(np.uint8)
    hit = rng.random((height, width)) < fraction
    choices = np.array([0, 1, 2, 3, 4, 255] if nodata else [0, 1, 2, 3, 4], np.uint8)
    lab[hit] = rng.choice(choices, int(hit.sum()))
    return lab


def assert_equal_polygons(expected: list[tuple[int, shapely.Geometry]],
                          got: list[tuple[int, shapely.Geometry]], exact: bool = False
                          ) -> None:
    """Same count per class, and the polygons of each class paired one to one with
    ``shapely.equals`` (the same point set); ``exact``: the same rings and vertices too
    (``normalize`` + ``equals_exact``: the same geometry up to where each ring starts)."""
    count = lambda rs: np.bincount([c for c, _ in rs], minlength=256)  # noqa: E731
    assert (count(expected) == count(got)).all(), "different number of regions per class"
    for cls in {c for c, _ in expected}:
        want = np.array([g for c, g in expected if c == cls], dtype=object)
        have = np.array([g for c, g in got if c == cls], dtype=object)
        assert shapely.is_valid(have).all()
        if exact:
            norm = lambda gs: sorted(shapely.to_wkb(shapely.normalize(gs)).tolist())  # noqa: E731
            assert norm(want) == norm(have), f"class {cls}: other rings or vertices"
            continue
        i, j = shapely.STRtree(have).query(shapely.point_on_surface(want),
                                          predicate="intersects")
        equal = shapely.equals(want[i], have[j])
        matched = np.bincount(i[equal], minlength=len(want))
        assert (matched == 1).all(), (
            f"class {cls}: {int((matched != 1).sum())} of {len(want)} polygons unmatched")
        assert len(set(j[equal].tolist())) == len(want)  # one-to-one
