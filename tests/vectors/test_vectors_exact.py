"""The streamed polygonizer equals rasterio.features.shapes on the whole array."""

from __future__ import annotations

import numpy as np
import pytest
import shapely
from helpers.vectors import GEO, assert_same_regions, make_labels, reference

from seg_at_scale.vectors import MergeStats, polygonize
from seg_at_scale.vectors.write import to_map

SMALL = make_labels(203, 171)
LARGE = make_labels(517, 743, seed=3)


def streamed(labels, connectivity, strip_rows, **kw):
    return [(r.class_id, r.geometry)
            for r in polygonize(labels, connectivity=connectivity, strip_rows=strip_rows, **kw)]


@pytest.mark.parametrize("connectivity", [4, 8])
@pytest.mark.parametrize("strip_rows", [1, 2, 7, 64, 1000])
def test_equals_whole_array_small(connectivity, strip_rows):
    assert_same_regions(reference(SMALL, connectivity), streamed(SMALL, connectivity, strip_rows))


@pytest.mark.parametrize("connectivity", [4, 8])
@pytest.mark.parametrize("strip_rows", [7, 64, 600])
def test_equals_whole_array_large(connectivity, strip_rows):
    assert_same_regions(reference(LARGE, connectivity), streamed(LARGE, connectivity, strip_rows))


def test_a_single_strip_tiff_is_read_a_strip_at_a_time(tmp_path, monkeypatch):
    """tifffile's default TIFF is one strip: reading whole storage blocks read the whole
    raster at once (not "memory stays at one strip"). The polygons stay the same."""
    import tifffile

    from seg_at_scale.io import RasterReader

    tifffile.imwrite(tmp_path / "one_strip.tif", LARGE)
    heights = []
    read = RasterReader.read

    def spy(self, window, *args, **kwargs):
        heights.append(window.height)
        return read(self, window, *args, **kwargs)

    monkeypatch.setattr(RasterReader, "read", spy)
    got = streamed(str(tmp_path / "one_strip.tif"), 8, 64)
    assert heights and max(heights) <= 64
    assert_same_regions(reference(LARGE, 8), got)


def test_shapes_that_matter_are_there():
    """The test raster really has what the exactness tests are about."""
    ref4, ref8 = reference(SMALL, 4), reference(SMALL, 8)
    assert len(ref8) < len(ref4)  # diagonal contacts join regions only with 8
    holes = [shapely.get_num_interior_rings(g) for _, g in ref4 if g.geom_type == "Polygon"]
    assert max(holes) >= 2
    assert any(g.geom_type == "MultiPolygon" for _, g in ref8)  # joined at corners only
    tall = max(g.bounds[3] - g.bounds[1] for _, g in ref4)
    assert tall == SMALL.shape[0]  # some region spans every strip


def test_nested_rings_holes_and_islands():
    lab = np.zeros((40, 40), np.uint8)
    lab[5:35, 5:35] = 1
    lab[10:30, 10:30] = 2
    lab[15:25, 15:25] = 1  # an island of class 1 inside the hole of the ring of class 1
    lab[19:21, 19:21] = 255
    for conn in (4, 8):
        got = streamed(lab, conn, 3)
        assert sorted((c, g.area, shapely.get_num_interior_rings(g)) for c, g in got) == [
            (0, 1600 - 900, 1), (1, 100 - 4, 1), (1, 900 - 400, 1), (2, 400 - 100, 1)]
        assert_same_regions(reference(lab, conn), got)


def test_u_shapes_join_across_many_strips():
    """The arms of a U are separate for 30 strips, then one region; inverted U likewise."""
    lab = np.zeros((33, 20), np.uint8)
    lab[:, 2] = lab[:, 8] = lab[-1, 2:9] = 1
    lab[0, 11:18] = lab[:-1, 11] = lab[:-1, 17] = 2
    stats = MergeStats()
    got = [(r.class_id, r.pixels) for r in polygonize(lab, strip_rows=1, stats=stats)]
    assert sorted(g for g in got if g[0]) == [(1, 33 + 33 + 5), (2, 32 + 32 + 5)]
    assert stats.strips == 33
    assert stats.peak_open_regions >= 5  # background between and beside the arms too


@pytest.mark.parametrize("connectivity, expected", [(4, [4, 17]), (8, [1, 1])])
def test_diagonal_touching(connectivity, expected):
    lab = np.zeros((9, 9), np.uint8)
    lab[np.arange(9), np.arange(9)] = 1
    lab[np.arange(9), 8 - np.arange(9)] = 1  # an X: connected only through corners
    lab[0, 1] = lab[1, 0] = 255  # no data beside a corner contact
    got = streamed(lab, connectivity, 1)
    assert np.bincount([c for c, _ in got]).tolist() == expected  # background, X
    assert sum(g.area for c, g in got if c == 1) == int((lab == 1).sum()) == 17
    assert_same_regions(reference(lab, connectivity), got)


def test_all_nodata_and_single_class():
    assert streamed(np.full((9, 7), 255, np.uint8), 4, 2) == []
    got = streamed(np.full((9, 7), 3, np.uint8), 8, 2)
    assert [(c, g.area, g.bounds) for c, g in got] == [(3, 63.0, (0.0, 0.0, 7.0, 9.0))]


def test_classes_filter_keeps_only_those_and_their_exact_shapes():
    got = streamed(SMALL, 4, 16, classes=[1, 3])
    assert {c for c, _ in got} == {1, 3}
    expected = [(c, g) for c, g in reference(SMALL, 4) if c in (1, 3)]
    assert_same_regions(expected, got)


def test_map_coordinates_match_the_georeferenced_reference():
    got = [(c, g) for c, g in streamed(SMALL, 8, 7)]
    geoms = to_map(np.array([g for _, g in got], dtype=object), GEO)
    assert_same_regions(reference(SMALL, 8, GEO), [(c, g) for (c, _), g in zip(got, geoms)])


def test_pixels_equal_area_in_pixels_and_class_counts():
    regions = list(polygonize(LARGE, connectivity=4, strip_rows=64))
    assert all(r.pixels == r.geometry.area for r in regions)
    per_class = np.bincount([r.class_id for r in regions],
                            weights=[r.pixels for r in regions], minlength=5)
    assert per_class.tolist() == np.bincount(LARGE.ravel(), minlength=256)[:5].tolist()
