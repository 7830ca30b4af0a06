"""image_hrefs: the images of an ItemCollection / Catalog / Collection, hrefs resolved."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pystac
import pytest

from seg_at_scale.catalog import image_hrefs
from seg_at_scale.errors import InputError

WHEN = dt.datetime(2024, 6, 1, tzinfo=dt.timezone.utc)
BOX = {"type": "Polygon", "coordinates": [[[15, 40], [15.1, 40], [15.1, 40.1], [15, 40]]]}


def item(name: str, **assets: pystac.Asset) -> pystac.Item:
    it = pystac.Item(name, BOX, [15, 40, 15.1, 40.1], WHEN, {})
    for key, asset in assets.items():
        it.add_asset(key, asset)
    return it


def tiff(href: str, roles=("data",), media=pystac.MediaType.COG) -> pystac.Asset:
    return pystac.Asset(href, media_type=media, roles=list(roles))


def feature_collection(path: Path, *items: pystac.Item) -> Path:
    doc = {"type": "FeatureCollection",
           "features": [i.to_dict(include_self_link=False) for i in items]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def test_item_collection_relative_and_absolute_hrefs(tmp_path, monkeypatch):
    path = feature_collection(
        tmp_path / "archive" / "items.json",
        item("a", thumb=tiff("a.png", ("thumbnail",), pystac.MediaType.PNG),
             image=tiff("scenes/a.tif")),
        item("b", visual=tiff("/data/b.tif", (), pystac.MediaType.GEOTIFF)),
        item("c", image=tiff("../elsewhere/c.tif")),
        item("d", image=tiff("file:///mnt/d.tif")))
    monkeypatch.chdir(tmp_path)  # relative hrefs start at the JSON's folder, not here
    assert image_hrefs(path) == [
        ("a", str(tmp_path / "archive" / "scenes" / "a.tif")),
        ("b", "/data/b.tif"),
        ("c", str(tmp_path / "elsewhere" / "c.tif")),
        ("d", "/mnt/d.tif")]
    assert image_hrefs(json.loads(path.read_text()))[0] == ("a", str(tmp_path / "scenes/a.tif"))


def test_catalog_with_collections_and_items_in_subfolders(tmp_path):
    catalog = pystac.Catalog("archive", "test archive")
    collection = pystac.Collection("s2", "Sentinel-2", pystac.Extent(
        pystac.SpatialExtent([[15, 40, 15.1, 40.1]]), pystac.TemporalExtent([[WHEN, None]])))
    catalog.add_child(collection)
    collection.add_item(item("x", B04=tiff("./x_B04.tif")))
    catalog.add_item(item("y", data=tiff("./y.tif")))
    catalog.normalize_hrefs(str(tmp_path / "stac"))
    catalog.save(pystac.CatalogType.SELF_CONTAINED)
    found = dict(image_hrefs(tmp_path / "stac" / "catalog.json"))
    assert found == {"x": str(tmp_path / "stac" / "s2" / "x" / "x_B04.tif"),
                     "y": str(tmp_path / "stac" / "y" / "y.tif")}
    assert image_hrefs(tmp_path / "stac" / "s2" / "collection.json") == [
        ("x", found["x"])]


def test_asset_choice_and_the_asset_key(tmp_path):
    both = item("a", meta=tiff("meta.json", ("metadata",), pystac.MediaType.JSON),
                nir=tiff("nir.tif", ()), rgb=tiff("rgb.tif"))
    data_only = item("b", scene=tiff("b.jp2", ("data",), pystac.MediaType.JPEG2000))
    path = feature_collection(tmp_path / "items.json", both, data_only)
    assert image_hrefs(path) == [("a", str(tmp_path / "rgb.tif")),  # data + tiff first
                                 ("b", str(tmp_path / "b.jp2"))]
    one = feature_collection(tmp_path / "one.json", both)
    assert image_hrefs(one, asset="nir") == [("a", str(tmp_path / "nir.tif"))]


def test_refusals(tmp_path):
    path = feature_collection(tmp_path / "items.json", item(
        "S2_tile", meta=tiff("m.json", ("metadata",), pystac.MediaType.JSON),
        thumb=tiff("t.png", ("thumbnail",), pystac.MediaType.PNG)))
    with pytest.raises(InputError, match=r"item 'S2_tile' has no image asset .*its assets: "
                                         r"meta, thumb\); in the STAC JSON, give its image "
                                         r"asset the role 'data' or the type 'image/tiff"):
        image_hrefs(path)
    with pytest.raises(InputError, match=r"item 'S2_tile' has no asset 'B04' \(its assets: "
                                         r"meta, thumb\)"):
        image_hrefs(path, asset="B04")
    remote = feature_collection(tmp_path / "r.json", item("r", i=tiff("https://x.org/r.tif")))
    with pytest.raises(InputError, match=r"item 'r': the image 'https://x.org/r.tif' is a "
                                         r"URL \(https:\): .* copy it to a local or mounted"):
        image_hrefs(remote)
    virtual = feature_collection(tmp_path / "v.json", item("v", i=tiff("/vsis3/b/v.tif")))
    with pytest.raises(InputError, match="item 'v': the image '/vsis3/b/v.tif' is a GDAL "
                                         "virtual path"):
        image_hrefs(virtual)
    twice = feature_collection(tmp_path / "t.json", item("z", i=tiff("1.tif")),
                               item("z", i=tiff("2.tif")))
    with pytest.raises(InputError, match="two items have the id 'z'"):
        image_hrefs(twice)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InputError, match="cannot read '.*bad.json' as STAC JSON"):
        image_hrefs(tmp_path / "bad.json")
    (tmp_path / "geo.json").write_text('{"type": "Point", "coordinates": [0, 0]}')
    with pytest.raises(InputError, match="has type 'Point'; expected a STAC ItemCollection"):
        image_hrefs(tmp_path / "geo.json")


def test_a_catalogue_linking_a_missing_item_is_refused_in_one_line(tmp_path):
    catalog = pystac.Catalog("archive", "test archive")
    catalog.add_item(item("x", data=tiff("./x.tif")))
    catalog.add_item(item("y", data=tiff("./y.tif")))
    catalog.normalize_hrefs(str(tmp_path / "stac"))
    catalog.save(pystac.CatalogType.SELF_CONTAINED)
    (tmp_path / "stac" / "y" / "y.json").unlink()
    path = tmp_path / "stac" / "catalog.json"
    with pytest.raises(InputError) as exc:
        image_hrefs(path)
    assert str(exc.value).startswith(f"{path} is not a valid STAC Catalog: ")
    assert "y.json" in str(exc.value) and "\n" not in str(exc.value)
