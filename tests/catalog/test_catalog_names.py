"""Names and links taken from a STAC catalogue: outputs stay in output_dir, loops refused.

An item id ``../victim`` wrote ``victim.tif``, its preview and its Item one folder above
``output_dir`` (an absolute id: there); a catalogue whose links loop ended in pystac's
RecursionError traceback.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pystac
import pytest
from helpers.prediction import make_model, make_run, seg_predict_here
from test_catalog_inputs import feature_collection, item, tiff

import seg_at_scale.catalog.inputs as inputs
from seg_at_scale.catalog import image_hrefs
from seg_at_scale.catalog.names import MAX_STEM_BYTES, output_stem
from seg_at_scale.errors import InputError
from seg_at_scale.io import example_geotags, write_raster

OPTS = ("ckpt=last", "tile_size=96", "progress=false")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("names") / "run",
                    make_model("same", levels=3, width=8))


def _tree(root: Path) -> set[str]:
    """Every file and folder under ``root``, relative to it."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _scene(path: Path, seed: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = np.random.default_rng(seed).integers(0, 255, (4, 40, 36)).astype(np.uint8)
    return write_raster(path, img, geotags=example_geotags(pixel_size=10.0))


def _one_line_refusal(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr + res.stdout
    return lines[0]


@pytest.mark.parametrize(("name", "stem"), [
    ("S2A_T33UUP_20240601", "S2A_T33UUP_20240601"), ("a.b c", "a.b c"),
    ("../victim", "victim"), ("/some/where/x", "some_where_x"), ("a/../b", "a_b"),
    ("..\\..\\x", "x"), ("C:\\data\\x", "C:_data_x"), (".hidden", "hidden"),
    (" . .x ", "x"), ("x\ny", "x_y")])
def test_a_name_becomes_one_plain_file_name(name, stem):
    assert output_stem(name, what="w") == stem


@pytest.mark.parametrize("name", ["", ".", "..", "../..", "/", " ", "\t", "./ /."])
def test_a_name_that_becomes_empty_is_refused(name):
    with pytest.raises(InputError, match=r"^item 'x' gives no output name: .* give it a "
                                         r"name with letters or digits$"):
        output_stem(name, what="item 'x'")


def test_a_name_too_long_for_its_companions_is_refused():
    assert output_stem("é" * (MAX_STEM_BYTES // 2), what="w") == "é" * (MAX_STEM_BYTES // 2)
    with pytest.raises(InputError, match=f"of {MAX_STEM_BYTES + 2} bytes .* at most "
                                         f"{MAX_STEM_BYTES} bytes$"):
        output_stem("é" * (MAX_STEM_BYTES // 2 + 1), what="w")


def test_hostile_item_ids_write_nothing_outside_output_dir(run, tmp_path):
    a, b = _scene(tmp_path / "scenes" / "a.tif", 0), _scene(tmp_path / "scenes" / "b.tif", 1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "work" / "out"
    out.parent.mkdir()  # where '../victim' wrote
    items = feature_collection(tmp_path / "items.json",
                               item("../victim", image=tiff(str(a))),
                               item(str(elsewhere / "x"), image=tiff(str(b))))
    before = _tree(tmp_path)
    res = seg_predict_here(f"run={run}", *OPTS, f"images={items}", f"output_dir={out}")
    assert res.returncode == 0, res.stderr[-3000:]
    new = _tree(tmp_path) - before
    assert new and all(p == "work/out" or p.startswith("work/out/") for p in new), sorted(new)
    safe = output_stem(str(elsewhere / "x"), what="w")
    for stem in ("victim", safe):
        for name in (f"{stem}.tif", f"{stem}_preview.png", f"{stem}.stac.json"):
            assert (out / name).is_file(), name
    assert {f["id"] for f in json.loads((out / "items.json").read_text())["features"]} == \
        {"victim", safe}


@pytest.mark.parametrize(("ids", "message"), [
    (["ok", ""], r"item '' gives no output name: '' is empty"),
    (["..", "ok"], r"item '\.\.' gives no output name: '\.\.' is empty"),
    (["../v", "v"], r"would both be written as 'v' \(from '\.\./v' and 'v'\); give the items "
                    r"distinct ids$"),
    (["/v", "x", "v"], r"would both be written as 'v' \(from '/v' and 'v'\)")])
def test_ids_empty_or_one_name_once_made_safe_are_refused_before_any_work(run, tmp_path, ids,
                                                                          message):
    images = [_scene(tmp_path / "scenes" / f"{k}.tif", k) for k in range(len(ids))]
    items = feature_collection(tmp_path / "items.json", *(
        item(name, image=tiff(str(path))) for name, path in zip(ids, images, strict=True)))
    before = _tree(tmp_path)
    res = seg_predict_here(f"run={run}", *OPTS, f"images={items}",
                           f"output_dir={tmp_path / 'work' / 'out'}", "overwrite=true")
    assert re.search(message, _one_line_refusal(res))
    assert _tree(tmp_path) == before


def _catalog(path: Path, name: str, *children: str, items: tuple[str, ...] = ()) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    links = [{"rel": "child", "href": c} for c in children] + \
        [{"rel": "item", "href": i} for i in items]
    path.write_text(json.dumps({"type": "Catalog", "stac_version": "1.0.0", "id": name,
                                "description": name, "links": links}))
    return path


def _item_file(path: Path, name: str, image: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(item(name, image=tiff(image)).to_dict(include_self_link=False)))
    return path


def test_a_catalogue_whose_links_loop_is_refused_in_one_line(run, tmp_path):
    _catalog(tmp_path / "stac" / "c1.json", "c1", "./sub/c2.json")
    _catalog(tmp_path / "stac" / "sub" / "c2.json", "c2", "../c1.json")
    me = _catalog(tmp_path / "stac" / "me.json", "me", "./me.json")
    with pytest.raises(InputError, match=r"c1.json: its catalogue links loop \(c1.json -> "
                                         r"sub/c2.json -> c1.json\); remove the 'child' link "
                                         r"of 'sub/c2.json' that points back$"):
        image_hrefs(tmp_path / "stac" / "c1.json")
    with pytest.raises(InputError, match=r"me.json -> me.json\)"):
        image_hrefs(me)
    before = _tree(tmp_path)
    line = _one_line_refusal(seg_predict_here(
        f"run={run}", *OPTS, f"images={tmp_path / 'stac' / 'c1.json'}",
        f"output_dir={tmp_path / 'out'}"))
    assert "its catalogue links loop (c1.json -> sub/c2.json -> c1.json)" in line
    assert _tree(tmp_path) == before


def test_a_catalogue_reached_twice_is_walked_once(tmp_path):
    _item_file(tmp_path / "stac" / "x" / "x.json", "x", "./x.tif")
    _catalog(tmp_path / "stac" / "shared.json", "shared", items=("./x/x.json",))
    _catalog(tmp_path / "stac" / "a.json", "a", "./shared.json")
    _catalog(tmp_path / "stac" / "top.json", "top", "./a.json", "./shared.json")
    assert image_hrefs(tmp_path / "stac" / "top.json") == [
        ("x", str(tmp_path / "stac" / "x" / "x.tif"))]


def test_the_walk_is_bounded_in_depth_and_count(tmp_path, monkeypatch):
    for k in range(4):
        _catalog(tmp_path / "stac" / f"c{k}.json", f"c{k}", f"./c{k + 1}.json",
                 items=(f"./i{k}.json",))
        _item_file(tmp_path / "stac" / f"i{k}.json", f"i{k}", f"./i{k}.tif")
    _catalog(tmp_path / "stac" / "c4.json", "c4")
    top = tmp_path / "stac" / "c0.json"
    assert [name for name, _ in image_hrefs(top)] == ["i0", "i1", "i2", "i3"]
    monkeypatch.setattr(inputs, "MAX_DEPTH", 3)
    with pytest.raises(InputError, match=r"c0.json: catalogues nest more than 3 deep "
                                         r"\(MAX_DEPTH, the bound of the walk\) at 'c3.json'"):
        image_hrefs(top)
    monkeypatch.setattr(inputs, "MAX_DEPTH", 64)
    monkeypatch.setattr(inputs, "MAX_LINKED", 5)
    with pytest.raises(InputError, match=r"c0.json links more than 5 catalogues and items "
                                         r"\(MAX_LINKED, the bound of the walk\)"):
        image_hrefs(top)


def test_a_child_link_to_an_item_is_refused(tmp_path):
    _item_file(tmp_path / "i.json", "i", "./i.tif")
    top = _catalog(tmp_path / "top.json", "top", "./i.json")
    with pytest.raises(InputError, match=r"the 'child' link '.*i.json' is a STAC Item, not a "
                                         r"Catalog; fix the link$"):
        image_hrefs(top)


def test_pystac_catalogue_still_reads(tmp_path):
    catalog = pystac.Catalog("archive", "test archive")
    catalog.add_item(item("x", data=tiff("./x.tif")))
    catalog.normalize_hrefs(str(tmp_path / "stac"))
    catalog.save(pystac.CatalogType.SELF_CONTAINED)
    assert image_hrefs(tmp_path / "stac" / "catalog.json") == [
        ("x", str(tmp_path / "stac" / "x" / "x.tif"))]
