"""write_vectors: real input formats, attributes, CRS round-trip per format, options, refusals."""

from __future__ import annotations

import shutil

import geopandas as gpd
import numpy as np
import pytest
import shapely
import zarr
from affine import Affine
from helpers.vectors import (
    GEO,
    NAMES,
    assert_same_regions,
    make_labels,
    probabilities,
    reference,
    write_store,
    write_tiff,
)
from scipy import ndimage

from seg_at_scale.errors import ConfigError, InputError, OutputExistsError
from seg_at_scale.io import write_raster
from seg_at_scale.vectors import georeference, write_vectors

LABELS = make_labels(203, 171, seed=5)


def read(path):
    return gpd.read_parquet(path) if path.suffix == ".parquet" else gpd.read_file(path)


def features(df):
    return list(zip(df.class_id.tolist(), df.geometry.to_numpy()))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("store")
    return write_store(folder / "scene_mask.zarr", LABELS, probabilities(LABELS), tile=64)


def test_georeference_of_store_and_tiff(store, tmp_path):
    tif = write_tiff(tmp_path / "mask.tif", LABELS)
    for source in (store, tif):
        transform, crs = georeference(source)
        assert transform == GEO
        assert crs.to_epsg() == 32633
    plain = write_raster(tmp_path / "plain.tif", LABELS)  # no GeoTIFF tags
    assert georeference(plain) == (Affine.identity(), None)


@pytest.mark.parametrize("ext", [".gpkg", ".parquet", ".fgb"])
def test_each_format_round_trips_geometry_and_crs(store, tmp_path, ext):
    out = tmp_path / f"scene{ext}"
    stats = write_vectors(store, out, connectivity=8, strip_rows=7)
    df = read(out)
    assert df.crs.to_epsg() == 32633
    assert set(df.geom_type) == {"MultiPolygon"}
    assert_same_regions(reference(LABELS, 8, GEO), features(df), tolerance=1e-6)
    assert sum(stats.features.values()) == len(df)
    assert stats.features == df.class_name.value_counts().to_dict()
    assert not list(tmp_path.glob(".*"))  # no temporary left


@pytest.mark.parametrize("name", ["-dash.gpkg", "gpkg_x.gpkg", "sqlite_y.gpkg", "+p.gpkg",
                                  "-dash.fgb"])
def test_names_geopackage_reserves_still_write_their_polygons(store, tmp_path, name):
    """Before: a scene named ``-dash`` or ``gpkg_x`` with ``vector=gpkg`` ended in pyogrio's
    "The layer name may not ..." traceback after the labels were written (an archive
    stopped, on_error=skip or not)."""
    import pyogrio

    plain = tmp_path / f"plain{name[name.index('.'):]}"
    write_vectors(store, plain, connectivity=8)
    write_vectors(store, tmp_path / name, connectivity=8)
    assert features(read(tmp_path / name)) == features(read(plain))
    (layer,) = pyogrio.list_layers(tmp_path / name)[:, 0]
    stem = name[:name.index(".")]
    assert layer == (f"layer_{stem}" if name.endswith(".gpkg") else stem)


def test_attributes_equal_numpy_on_each_region(store, tmp_path):
    out = tmp_path / "scene.gpkg"
    write_vectors(store, out, probabilities=store, strip_rows=16)
    df = read(out)
    probs = probabilities(LABELS)
    assert df.class_name.tolist() == [NAMES[c] for c in df.class_id]
    assert np.array_equal(df.area, df.pixels * 1.0)  # 1 m pixels
    comps = {c: ndimage.label(LABELS == c)[0] for c in range(5)}  # 4-connectivity
    inv = ~GEO
    for row in df.itertuples():
        x, y = shapely.point_on_surface(row.geometry).coords[0]
        col, r = (int(v) for v in inv @ (x, y))
        region = comps[row.class_id] == comps[row.class_id][r, col]
        assert row.pixels == region.sum()
        assert row.mean_probability == pytest.approx(
            probs[row.class_id][region].mean() / 255, rel=1e-12)


def test_tiff_input_with_float_probabilities_and_pixel_area(tmp_path):
    tif = write_tiff(tmp_path / "scene_mask.tif", LABELS)
    probs = probabilities(LABELS).astype(np.float32) / 255
    ptif = write_tiff(tmp_path / "scene_mask_probabilities.tif", probs)
    out = tmp_path / "scene.fgb"
    stats = write_vectors(tif, out, class_names=NAMES, probabilities=ptif, classes=[2],
                          min_area=3.0)
    df = read(out)
    assert set(df.class_id) == {2}
    want = [(c, g) for c, g in reference(LABELS, 4, GEO) if c == 2 and g.area >= 3]
    assert_same_regions(want, features(df), tolerance=1e-6)
    assert stats.dropped == sum(1 for c, g in reference(LABELS, 4) if c == 2 and g.area < 3)
    assert df.mean_probability.between(0, 1).all()


def test_array_input_min_area_in_crs_units(tmp_path):
    from rasterio.crs import CRS

    transform = Affine(10.0, 0.0, 300000.0, 0.0, -10.0, 5000000.0)  # 100 m² pixels
    out = tmp_path / "a.parquet"
    stats = write_vectors(LABELS, out, class_names=NAMES, min_area=500.0, transform=transform,
                          crs=CRS.from_epsg(32632))
    df = read(out)
    assert df.crs.to_epsg() == 32632
    assert (df.pixels >= 5).all() and np.array_equal(df.area, df.pixels * 100.0)
    small = sum(1 for _, g in reference(LABELS, 4) if g.area < 5)
    assert stats.dropped == small and len(df) == len(reference(LABELS, 4)) - small


def test_existing_output_is_refused_unless_overwrite(store, tmp_path):
    out = tmp_path / "scene.gpkg"
    out.write_text("precious")
    with pytest.raises(OutputExistsError, match="scene.gpkg' already exists; pass overwrite"):
        write_vectors(store, out)
    assert out.read_text() == "precious"
    write_vectors(store, out, overwrite=True, classes=[4])
    assert set(read(out).class_id) == {4}


@pytest.mark.parametrize("name", ["scene.shp", "scene.geojson", "scene"])
def test_unknown_extension_is_refused(store, tmp_path, name):
    with pytest.raises(ConfigError, match=r"vector '.*': unknown vector extension '.*'; use "
                       r"\.gpkg \(GeoPackage\), \.parquet \(GeoParquet\), \.fgb \(FlatGeobuf\)"):
        write_vectors(store, tmp_path / name, key="vector")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kw, match", [
    ({"connectivity": 6}, "connectivity=6: use 4"),
    ({"classes": [1, 255]}, r"classes=\[1, 255\] holds \[255\]"),
    ({"min_area": -1}, "min_area=-1: use a number >= 0"),
    ({"simplify": float("nan")}, "simplify=nan"),
    ({"strip_rows": 0}, "strip_rows=0"),
])
def test_bad_options_are_refused(store, tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        write_vectors(store, tmp_path / "x.gpkg", **kw)
    assert list(tmp_path.iterdir()) == []


def test_bad_inputs_are_refused(store, tmp_path):
    with pytest.raises(InputError, match="class_names lists 2 names"):
        write_vectors(store, tmp_path / "a.gpkg", class_names=["a", "b"])
    with pytest.raises(InputError, match=r"probabilities .* are 9x9 but the labels are 203x171"):
        write_vectors(store, tmp_path / "b.gpkg", probabilities=np.zeros((5, 9, 9), np.uint8))
    with pytest.raises(InputError, match="have 2 bands"):
        write_vectors(store, tmp_path / "c.gpkg", probabilities=probabilities(LABELS, 2))
    unfinished = write_store(tmp_path / "u.zarr", LABELS)
    zarr.open_group(unfinished, mode="r+").attrs["complete"] = False
    with pytest.raises(InputError, match="u.zarr' is an unfinished prediction"):
        write_vectors(unfinished, tmp_path / "e.gpkg")
    shutil.rmtree(unfinished)
    floats = write_tiff(tmp_path / "f.tif", LABELS.astype(np.float32))
    with pytest.raises(InputError, match="f.tif' has 1 band.* of float32; a label raster is"):
        write_vectors(floats, tmp_path / "d.gpkg")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.tif"]


def test_a_labels_raster_placed_by_control_points_is_said_to_give_pixel_polygons(tmp_path,
                                                                                 caplog):
    """Before: polygons of an output georeferenced by GCPs came in pixel coordinates, with no
    CRS, without a word."""
    import rasterio
    from rasterio.control import GroundControlPoint

    path = tmp_path / "gcps.tif"
    with rasterio.open(path, "w", driver="GTiff", height=203, width=171, count=1,
                       dtype="uint8") as ds:
        ds.write(LABELS[None])
        ds.gcps = ([GroundControlPoint(0, 0, 500000, 4500000),
                    GroundControlPoint(0, 171, 501710, 4500000),
                    GroundControlPoint(203, 0, 500000, 4497970)],
                   rasterio.crs.CRS.from_epsg(32633))
    with caplog.at_level("WARNING", logger="seg_at_scale.vectors.sources"):
        write_vectors(path, tmp_path / "v.gpkg", connectivity=8)
    assert [r.getMessage() for r in caplog.records] == [
        f"'{path}' is georeferenced by 3 ground control points, which polygons do not follow: "
        "they are in pixel coordinates; warp the image first (gdalwarp) to have them in its CRS"]
    assert read(tmp_path / "v.gpkg").crs is None
