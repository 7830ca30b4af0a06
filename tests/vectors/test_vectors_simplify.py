"""Coverage simplification: neighbours keep shared edges (no gaps, no overlaps)."""

from __future__ import annotations

import geopandas as gpd
import numpy as np
import pytest
import shapely
from helpers.vectors import make_labels, write_store

from seg_at_scale.vectors import polygonize, write_vectors
from seg_at_scale.vectors.simplify import edge_matched

LABELS = make_labels(203, 171, seed=5)


@pytest.mark.parametrize("connectivity", [4, 8])
def test_edge_matching_keeps_every_shape_and_makes_a_coverage(connectivity):
    geoms = np.array([r.geometry for r in polygonize(LABELS, connectivity=connectivity,
                                                     strip_rows=7)], dtype=object)
    assert not shapely.coverage_is_valid(geoms)  # T junctions lack vertices
    matched = edge_matched(geoms)
    assert shapely.coverage_is_valid(matched)
    assert shapely.equals(matched, geoms).all()
    assert (shapely.get_type_id(matched) == shapely.get_type_id(geoms)).all()
    assert shapely.get_num_coordinates(matched).sum() < 1.1 * shapely.get_num_coordinates(
        geoms).sum()  # only the missing vertices, not every pixel corner


def test_simplify_keeps_a_coverage(tmp_path):
    store = write_store(tmp_path / "m.zarr", LABELS)
    write_vectors(store, tmp_path / "e.gpkg")
    write_vectors(store, tmp_path / "s.gpkg", simplify=2.0)
    exact, simple = gpd.read_file(tmp_path / "e.gpkg"), gpd.read_file(tmp_path / "s.gpkg")
    assert len(simple) == len(exact)
    assert simple.drop(columns="geometry").equals(exact.drop(columns="geometry"))
    geoms = simple.geometry.to_numpy()
    assert shapely.is_valid(geoms).all() and not shapely.is_empty(geoms).any()
    assert shapely.coverage_is_valid(geoms)  # neighbours share edges: no gaps or overlaps
    assert shapely.get_num_coordinates(geoms).sum() < 0.9 * shapely.get_num_coordinates(
        exact.geometry.to_numpy()).sum()
    # the outline of the whole coverage moves by less than the tolerance
    outline = shapely.union_all(exact.geometry.to_numpy())
    assert shapely.hausdorff_distance(shapely.union_all(geoms), outline) <= 2.0
    # per-polygon simplification is not a coverage any more
    assert not shapely.coverage_is_valid(shapely.simplify(exact.geometry.to_numpy(), 2.0))
