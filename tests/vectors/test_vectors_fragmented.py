"""Fragmented labels (issue #39): checkerboards and 50% noise at an odd size.

The polygonizer was super-linear there (``shapely.make_valid`` on regions of thousands of
corner-joined squares). These tests hold what must not change while it is fast: the
polygons per class are rasterio's (whole array) and the same streamed in strips of any
height as read whole, every geometry valid; and that no overlay or repair is called at
all (what made it slow). No timing is asserted: ``experiments/bench_polygonize.py``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import rasterio.features
import shapely
from helpers.vectors import (
    assert_equal_polygons,
    assert_same_regions,
    checkerboard_labels,
    noise_labels,
    reference,
)
from shapely.geometry import shape

from seg_at_scale.vectors import polygonize
from seg_at_scale.vectors.stitch import _cycles, stitch
from seg_at_scale.vectors.trace import trace

H, W = 37, 53
RASTERS = {
    "checkerboard": checkerboard_labels(H, W),
    "checkerboard_nodata": checkerboard_labels(H, W, nodata=True),
    "noise50": noise_labels(H, W, seed=0),
    "noise50_nodata": noise_labels(H, W, seed=1, nodata=True),
}


@functools.cache
def whole_reference(name: str, connectivity: int) -> list:
    return reference(RASTERS[name], connectivity)


def regions(labels, connectivity, strip_rows):
    return [(r.class_id, r.geometry) for r in polygonize(labels, connectivity=connectivity,
                                                         strip_rows=strip_rows)]


def test_the_rasters_are_fragmented():
    board, noise = RASTERS["checkerboard"], RASTERS["noise50"]
    assert len(whole_reference("checkerboard", 4)) == H * W  # every pixel its own region
    per_class = np.bincount([c for c, _ in whole_reference("checkerboard", 8)])
    assert per_class[0] == 1  # class 0: one region of squares joined only at corners
    assert per_class[1:].sum() > 100  # classes 1..3: a region per block of corner-joins
    ref8 = whole_reference("noise50", 8)
    assert len(whole_reference("noise50", 4)) > len(ref8) > 200
    assert (np.diff(noise, axis=1) != 0).mean() > 0.5  # runs average under 2 pixels
    assert set(np.unique(board)) == {0, 1, 2, 3} and len(np.unique(noise)) == 5


@pytest.mark.parametrize("name", sorted(RASTERS))
@pytest.mark.parametrize("connectivity", [4, 8])
@pytest.mark.parametrize("strip_rows", [1, 2, 5, 16, None])
def test_equals_rasterio_on_the_whole_array(name, connectivity, strip_rows):
    got = regions(RASTERS[name], connectivity, strip_rows)
    expected = whole_reference(name, connectivity)
    assert_equal_polygons(expected, got, exact=connectivity == 4)  # GDAL's own vertices
    assert_same_regions(expected, got)


@pytest.mark.parametrize("name", sorted(RASTERS))
@pytest.mark.parametrize("connectivity", [4, 8])
def test_streamed_equals_whole_raster(name, connectivity):
    whole = regions(RASTERS[name], connectivity, None)
    for strip_rows in (1, 3, 7, 36):
        assert_equal_polygons(whole, regions(RASTERS[name], connectivity, strip_rows),
                              exact=True)


@pytest.mark.parametrize("name", sorted(RASTERS))
@pytest.mark.parametrize("connectivity", [4, 8])
def test_union_per_class_is_the_raster(name, connectivity):
    """Per class, the regions tile exactly the class's pixels: no overlap, no gap."""
    labels = RASTERS[name]
    got = list(polygonize(labels, connectivity=connectivity, strip_rows=4))
    for cls in np.unique(labels[labels != 255]):
        geoms = [r.geometry for r in got if r.class_id == cls]
        rows, cols = np.nonzero(labels == cls)
        pixels = shapely.union_all(shapely.box(cols, rows, cols + 1, rows + 1))
        assert shapely.equals(shapely.union_all(geoms), pixels)
        assert sum(g.area for g in geoms) == len(rows)  # pairwise disjoint too
        assert all(r.pixels == r.geometry.area for r in got)


def test_8_connected_regions_are_multipolygons_of_4_connected_parts():
    got = list(polygonize(RASTERS["checkerboard"], connectivity=8, strip_rows=5))
    zero = [r for r in got if r.class_id == 0]
    assert len(zero) == 1 and zero[0].geometry.geom_type == "MultiPolygon"
    parts = shapely.get_parts(zero[0].geometry)
    assert len(parts) == zero[0].pixels == (RASTERS["checkerboard"] == 0).sum()
    assert set(shapely.area(parts).tolist()) == {1.0}


@pytest.mark.parametrize("connectivity", [4, 8])
def test_no_overlay_and_no_repair(monkeypatch, connectivity):
    """What made fragmented labels slow is never called: ``make_valid`` (super-linear on
    corner-joined squares) nor an overlay union across seams."""
    def refuse(*args, **kwargs):
        raise AssertionError("called")

    for name in ("make_valid", "union_all", "unary_union", "union", "coverage_union_all"):
        monkeypatch.setattr(shapely, name, refuse)
    for labels in RASTERS.values():
        for strip_rows in (1, 6, None):
            assert regions(labels, connectivity, strip_rows)


# -- the pieces: tracing, stitching, cycles --------------------------------------------

def gdal(labels, row=0):
    """GDAL's 4-connected polygons of ``labels``, shifted down ``row`` rows."""
    transform = rasterio.Affine.translation(0, row)
    return [shape(g) for g, _ in rasterio.features.shapes(
        labels, mask=labels != 255, connectivity=4, transform=transform)]


def normalized(geoms):
    return sorted(shapely.to_wkb(shapely.normalize(np.array(geoms, dtype=object))).tolist())


@pytest.mark.parametrize("seed", range(4))
def test_trace_is_gdals_polygons_vertex_for_vertex(seed):
    import sys

    components = sys.modules["seg_at_scale.vectors.polygonize"]._Components
    rng = np.random.default_rng(seed)
    for _ in range(60):
        h, w = rng.integers(1, 24, 2)
        lab = rng.integers(0, rng.integers(1, 5), (h, w)).astype(np.uint8)
        if rng.random() < 0.5:
            lab[rng.random((h, w)) < 0.2] = 255
        comp = components(lab, None, 4)
        got = trace(comp.run_starts, comp.run_part, h, w, comp.count, 11)
        assert normalized(got) == normalized(gdal(lab, 11))
        assert shapely.is_valid(got).all()


@pytest.mark.parametrize("seed", range(4))
def test_stitch_is_the_whole_regions_polygon(seed):
    """Pieces of one region from strips of every height join into GDAL's polygon of the
    whole region, vertex for vertex (pinches between pieces of one strip included)."""
    from scipy import ndimage

    rng = np.random.default_rng(seed)
    for _ in range(30):
        h, w = rng.integers(2, 30, 2)
        lab = rng.integers(0, 3, (h, w)).astype(np.uint8)
        strip = int(rng.integers(1, h))
        comp = np.zeros((h, w), np.int64)
        n = 0
        for c in range(3):
            ids, k = ndimage.label(lab == c)
            comp[ids > 0] = ids[ids > 0] + n
            n += k
        whole = {}
        for g in gdal(lab):
            p = g.representative_point()
            whole[comp[int(p.y), int(p.x)]] = g
        pieces, owner = [], []
        for r in range(0, h, strip):
            for g in gdal(lab[r : r + strip], r):
                p = g.representative_point()
                pieces.append(g)
                owner.append(comp[int(p.y), int(p.x)])
        owner = np.array(owner)
        multi = np.flatnonzero(np.bincount(owner) > 1)
        if not multi.size:
            continue
        sel = np.isin(owner, multi)
        ids, index = np.unique(owner[sel], return_inverse=True)
        got = stitch(np.array(pieces, dtype=object)[sel], index, np.arange(strip, h, strip))
        assert normalized(got) == normalized([whole[i] for i in ids])
        assert shapely.is_valid(got).all()


def test_cycles_of_permutations():
    rng = np.random.default_rng(0)
    for n in [1, 2, 17, 100, 3000]:
        for nxt in (rng.permutation(n), np.roll(np.arange(n), -1)):
            order, cycle = _cycles(nxt)
            assert sorted(order.tolist()) == list(range(n))
            same = cycle[1:] == cycle[:-1]
            assert (nxt[order[:-1]][same] == order[1:][same]).all()  # in order
            ends = np.r_[np.flatnonzero(~same), n - 1]
            starts = np.r_[0, ends[:-1] + 1]
            assert (nxt[order[ends]] == order[starts]).all()  # each closes on itself
