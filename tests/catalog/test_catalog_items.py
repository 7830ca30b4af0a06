"""stac_item / write_item / write_item_collection: fields checked one by one (no network:
pystac's validate() would fetch the schemas)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pystac
import pytest
import rasterio
import shapely
import tifffile
from helpers.vectors import GEO, NAMES, make_labels, write_store, write_tiff
from pyproj import Transformer
from shapely.geometry import shape

from seg_at_scale.catalog import (
    image_hrefs,
    item_collection,
    stac_item,
    write_item,
    write_item_collection,
)
from seg_at_scale.errors import InputError

LABELS = make_labels(203, 171)
MODEL = {"run": "runs/unet_s", "fingerprint": "sha256:0123abcd"}


@pytest.fixture()
def files(tmp_path):
    image = tmp_path / "scenes" / "scene.tif"
    image.parent.mkdir()
    tifffile.imwrite(image, np.zeros((8, 8), np.uint8), datetime="2024:06:01 10:30:00")
    (tmp_path / "out").mkdir()
    return image, write_tiff(tmp_path / "out" / "scene_mask.tif", LABELS)


def sha256_multihash(path):
    return "1220" + hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_item_of_a_tiff_round_trips_with_every_field(files):
    image, out = files
    path = write_item(stac_item(out, source_image=image, class_names=NAMES, model=MODEL), out)
    assert path == out.with_name("scene_mask.stac.json")
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []
    item = pystac.Item.from_file(str(path))
    assert item.id == "scene_mask"
    assert item.properties["proj:code"] == "EPSG:32633"
    assert item.properties["proj:shape"] == [203, 171]
    assert item.properties["proj:transform"] == list(GEO)[:6]
    assert item.properties["seg_at_scale:model"] == MODEL
    assert item.datetime == dt.datetime(2024, 6, 1, 10, 30, tzinfo=dt.timezone.utc)
    assert item.properties["seg_at_scale:datetime_source"] == "DateTime tag of scene.tif"
    asset = item.assets["labels"]
    assert asset.href == "./scene_mask.tif"  # relative: the folder moves as a whole
    assert asset.get_absolute_href() == str(out)
    assert asset.extra_fields["file:checksum"] == sha256_multihash(out)
    assert asset.extra_fields["file:size"] == out.stat().st_size
    assert asset.extra_fields["raster:bands"] == [{"nodata": 255, "data_type": "uint8"}]
    classes = asset.extra_fields["classification:classes"]
    assert [(c["value"], c.get("description")) for c in classes] == [
        *enumerate(NAMES), (255, None)]
    assert classes[-1]["nodata"] is True
    assert all(len(c["color_hint"]) == 6 and c["color_hint"] == c["color_hint"].upper()
               for c in classes[:-1])
    assert [(link.get_href(), link.media_type) for link in item.get_links("derived_from")] == [
        (str(image), "image/tiff; application=geotiff")]
    assert {e.split("/")[3] for e in item.stac_extensions} == {
        "projection", "raster", "classification", "file"}


def test_footprint_is_in_wgs84(files):
    image, out = files
    item = stac_item(out, source_image=image, class_names=NAMES)
    to_wgs84 = Transformer.from_crs(32633, 4326, always_xy=True)
    corners = [to_wgs84.transform(*(GEO @ xy)) for xy in ((0, 0), (171, 0), (171, 203),
                                                            (0, 203))]
    centre = shapely.Point(to_wgs84.transform(*(GEO @ (85.5, 101.5))))
    footprint = shape(item.geometry)
    assert footprint.contains(centre)
    lon, lat = zip(*corners)
    assert item.bbox == pytest.approx([min(lon), min(lat), max(lon), max(lat)], abs=1e-9)
    assert 14.9 < centre.x < 15.1  # UTM 33N's central meridian is 15 E


def test_item_of_a_store_with_colours_and_extra_assets(files, tmp_path):
    image, _ = files
    store = write_store(tmp_path / "out" / "scene_mask.zarr", LABELS)
    vec = tmp_path / "out" / "scene.gpkg"
    vec.write_bytes(b"not really a gpkg, only its checksum matters here")
    item = stac_item(store, source_image=image, class_names=NAMES, vectors=vec,
                     colours=[(255, 0, 0), "#00ff00", "0000FF", (1, 2, 3), (16, 32, 48)])
    assert item.properties["proj:shape"] == [203, 171]
    assert item.properties["proj:transform"] == list(GEO)[:6]
    labels = item.assets["labels"]
    assert labels.media_type == pystac.MediaType.ZARR
    size = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    assert labels.extra_fields["file:size"] == size
    assert "file:checksum" not in labels.extra_fields  # a folder has no single checksum
    hints = [c["color_hint"] for c in labels.extra_fields["classification:classes"][:5]]
    assert hints == ["FF0000", "00FF00", "0000FF", "010203", "102030"]
    assert item.assets["vectors"].media_type == pystac.MediaType.GEOPACKAGE
    assert item.assets["vectors"].extra_fields["file:checksum"] == sha256_multihash(vec)


def test_datetime_falls_back_to_now_and_says_so(tmp_path):
    image = write_tiff(tmp_path / "scene.tif", np.zeros((8, 8), np.uint8))  # no DateTime
    out = write_tiff(tmp_path / "mask.tif", LABELS)
    before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    item = stac_item(out, source_image=image, class_names=NAMES)
    assert before <= item.datetime <= dt.datetime.now(dt.timezone.utc)
    assert item.properties["seg_at_scale:datetime_source"] == "time the Item was made"


def test_a_crs_without_epsg_code_is_written_as_wkt2(tmp_path):
    wkt = ('PROJCS["custom LAEA",GEOGCS["WGS 84",DATUM["WGS_1984",SPHEROID["WGS 84",6378137,'
           '298.257223563]],PRIMEM["Greenwich",0],UNIT["degree",0.0174532925199433]],'
           'PROJECTION["Lambert_Azimuthal_Equal_Area"],PARAMETER["latitude_of_center",47.1],'
           'PARAMETER["longitude_of_center",9.3],PARAMETER["false_easting",0],'
           'PARAMETER["false_northing",0],UNIT["metre",1]]')
    out = tmp_path / "mask.tif"
    with rasterio.open(out, "w", driver="GTiff", width=171, height=203, count=1,
                       dtype="uint8", crs=rasterio.crs.CRS.from_wkt(wkt),
                       transform=rasterio.Affine(2, 0, -100, 0, -2, 200)) as ds:
        ds.write(LABELS[None])
    item = stac_item(out, source_image=out, class_names=NAMES)
    assert item.properties.get("proj:code") is None
    assert "Lambert Azimuthal Equal Area" in item.properties["proj:wkt2"]
    # the raster covers the projection centre (0, 0), which is 9.3 E 47.1 N
    assert shape(item.geometry).contains(shapely.Point(9.3, 47.1))


def test_item_collection_keeps_hrefs_working_after_a_move(files, tmp_path):
    image, out = files
    items = [stac_item(out, source_image=image, class_names=NAMES)]
    store = write_store(tmp_path / "out" / "b_mask.zarr", LABELS)
    items.append(stac_item(store, source_image=image, class_names=NAMES))
    collection = item_collection(items)
    assert [i.id for i in collection] == ["scene_mask", "b_mask"]
    path = write_item_collection(collection, tmp_path / "out" / "items.json")
    doc = json.loads(path.read_text())
    assert doc["type"] == "FeatureCollection"
    assert [f["assets"]["labels"]["href"] for f in doc["features"]] == [
        "./scene_mask.tif", "./b_mask.zarr"]
    moved = shutil.move(tmp_path / "out", tmp_path / "archive")
    assert image_hrefs(Path(moved) / "items.json") == [
        ("scene_mask", str(Path(moved) / "scene_mask.tif")),
        ("b_mask", str(Path(moved) / "b_mask.zarr"))]


def test_refusals(files, tmp_path):
    image, out = files
    with pytest.raises(InputError, match="source_image '.*nope.tif' does not exist"):
        stac_item(out, source_image=tmp_path / "nope.tif", class_names=NAMES)
    with pytest.raises(InputError, match="missing.tif"):
        stac_item(tmp_path / "missing.tif", source_image=image, class_names=NAMES)
    with pytest.raises(InputError, match="colours lists 2 colours for 5 classes"):
        stac_item(out, source_image=image, class_names=NAMES, colours=["FF0000", "00FF00"])
    with pytest.raises(InputError, match="'.*v.gpkg' does not exist; write the vectors"):
        stac_item(out, source_image=image, class_names=NAMES, vectors=tmp_path / "v.gpkg")
