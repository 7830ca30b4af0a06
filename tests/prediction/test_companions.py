"""What seg-predict writes beside a raster: polygons without seams, a STAC Item; and a rerun
that recognises its own finished work (skipped), completing only what is missing."""

from __future__ import annotations

import gc
import hashlib
import json
import warnings
from pathlib import Path

import geopandas as gpd
import numpy as np
import pystac
import rasterio
import shapely
import tifffile
from helpers.prediction import make_image, make_model, make_run, seg_predict_here
from helpers.vectors import PIXELS, assert_same_regions, reference

from seg_at_scale.io import read_raster
from seg_at_scale.io.geotags import open_dataset
from seg_at_scale.models.trained import load_run
from seg_at_scale.prediction.plan import model_digest


def _predict(run: Path, image: Path, out: Path, *extra: str) -> dict:
    res = seg_predict_here(f"run={run}", f"image={image}", f"output={out}", "ckpt=last",
                           "tile_size=96", "probabilities=uint8", *extra)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


def test_polygons_and_stac_item_beside_the_output_and_a_rerun_skips_what_is_done(tmp_path):
    run = make_run(tmp_path / "run", make_model("same", levels=3, width=8))
    image = make_image(tmp_path / "scene.tif", 203, 171)
    out, gpkg = tmp_path / "out" / "a.tif", tmp_path / "out" / "a.gpkg"
    first = _predict(run, image, out, f"vector={gpkg}", "vector_connectivity=8")
    assert first["tiles_computed"] == first["tiles"] > 4

    labels = read_raster(out)[0]
    with rasterio.open(out) as ds:
        transform, crs = ds.transform, ds.crs
    frame = gpd.read_file(gpkg)
    assert frame.crs == crs and len(frame) > 3
    assert set(frame.columns) >= {"class_id", "class_name", "area", "pixels", "mean_probability"}
    assert int(frame["pixels"].sum()) == int((labels != 255).sum())
    got = [(int(c), g) for c, g in zip(frame["class_id"], frame.geometry, strict=True)]
    assert_same_regions(reference(labels, 8, transform), got)  # the whole raster at once

    item = pystac.Item.from_file(str(out.with_name("a.stac.json")))
    asset = next(a for a in item.assets.values() if Path(a.href).name == "a.tif")
    sha = hashlib.sha256(out.read_bytes()).hexdigest()
    assert asset.extra_fields["file:checksum"] == "1220" + sha
    assert item.properties["proj:code"] == f"EPSG:{crs.to_epsg()}"
    names = [c["name"] for c in asset.extra_fields["classification:classes"]]
    assert names == ["background", "vegetation", "water", "road", "building", "no_data"]
    made_by = item.properties["seg_at_scale:model"]  # before: the prediction's digest alone
    # the Item records the prediction and the output it describes as its writer
    assert item.properties["seg_at_scale:written"]["prediction"] == \
        f"{made_by['prediction']} a.tif"
    assert made_by["weights"] == "sha256:" + model_digest(load_run(run).model)

    before = {p.name: p.read_bytes() for p in out.parent.iterdir()}
    gpkg.unlink()  # what a run killed while writing the polygons leaves (they appear whole)
    again = _predict(run, image, out, f"vector={gpkg}", "vector_connectivity=8")
    assert again["tiles_computed"] == 0 and again["tiles_resumed"] == first["tiles"]
    after = {p.name: p.read_bytes() for p in out.parent.iterdir()}
    assert after.keys() == before.keys()
    assert [k for k in after if k not in ("a.gpkg", ".a.gpkg.json", "a.stac.json")
            and after[k] != before[k]] == []  # the record: the new polygons' hash
    vectors = pystac.Item.from_file(str(out.with_name("a.stac.json"))).assets["vectors"]
    assert vectors.extra_fields["file:checksum"] == "1220" + hashlib.sha256(
        gpkg.read_bytes()).hexdigest()  # the Item names the polygons written again
    frame2 = gpd.read_file(gpkg)
    assert len(frame2) == len(frame) and shapely.equals(
        shapely.union_all(frame2.geometry.values), shapely.union_all(frame.geometry.values))


def test_an_output_another_prediction_made_is_refused_with_its_companions_intact(tmp_path):
    run = make_run(tmp_path / "run", make_model("same", levels=3, width=8))
    image = make_image(tmp_path / "scene.tif", 131, 97)
    out = tmp_path / "a.tif"
    _predict(run, image, out)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    res = seg_predict_here(f"run={run}", f"image={image}", f"output={out}", "ckpt=last",
                           "tile_size=64", "probabilities=uint8")
    assert res.returncode == 2 and "was made by another prediction" in res.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    mine = tmp_path / "mine.tif"
    mine.write_bytes(np.zeros(10, np.uint8).tobytes())  # not a prediction: never replaced
    res = seg_predict_here(f"run={run}", f"image={image}", f"output={mine}", "ckpt=last")
    assert res.returncode == 2 and "already exists; pass overwrite=true" in res.stderr


def test_an_image_without_georeferencing_predicts_in_pixel_coordinates_without_warnings(
        tmp_path):
    """A microscope's or a detector's TIFF has no georeferencing: nothing to warn about.

    rasterio's NotGeoreferencedWarning (opening the COG being written) and pyogrio's "'crs'
    was not provided" (writing the polygons) were printed for every such scene; and every
    file the prediction opens is closed by it (the input, the labels and probabilities the
    polygons and the STAC Item read), not left to the garbage collector.
    """
    run = make_run(tmp_path / "run", make_model("same", levels=3, width=8))
    pixels = read_raster(make_image(tmp_path / "geo.tif", 103, 89))
    image = tmp_path / "plain.tif"
    tifffile.imwrite(image, np.moveaxis(pixels, 0, -1))  # the same pixels, no GeoTIFF tags
    out, gpkg = tmp_path / "out" / "a.tif", tmp_path / "out" / "a.gpkg"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _predict(run, image, out, f"vector={gpkg}", "vector_connectivity=8")
        gc.collect()
    said = [f"{w.category.__name__}: {w.message}" for w in caught]
    assert not [s for s in said if "georeferenc" in s.lower() or "'crs'" in s
                or ("ResourceWarning" in s and str(tmp_path) in s)], said

    labels = read_raster(out)[0]
    with open_dataset(out) as ds:
        assert ds.crs is None and ds.transform.is_identity
    frame = gpd.read_file(gpkg)
    assert frame.crs is None and int(frame["pixels"].sum()) == int((labels != 255).sum())
    got = [(int(c), g) for c, g in zip(frame["class_id"], frame.geometry, strict=True)]
    assert_same_regions(reference(labels, 8, PIXELS), got)
    assert pystac.Item.from_file(str(out.with_name("a.stac.json"))).geometry is None
