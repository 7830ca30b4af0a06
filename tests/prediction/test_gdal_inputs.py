"""A scene given as a VRT mosaic of GeoTIFF pieces is predicted as the scene itself.

The same labels bit for bit as the one-file scene, the outputs placed where the mosaic is,
and the mosaic known by its pieces' bytes too: a finished output is reused while they are
unchanged, and refused as another prediction's once a piece changes.
"""

from __future__ import annotations

import json

import rasterio
from helpers.prediction import make_image, make_model, make_run, seg_predict_here

from seg_at_scale.io import RasterReader, example_geotags, read_raster, write_raster
from seg_at_scale.io.vrt import write_vrt
from seg_at_scale.prediction.plan import input_id


def _pieces(tmp_path, image, rows=(0, 150, 301), cols=(0, 201, 389)):
    paths = []
    for i in range(2):
        for j in range(2):
            r0, r1, c0, c1 = rows[i], rows[i + 1], cols[j], cols[j + 1]
            tags = example_geotags((500000.0 + 10.0 * c0, 4500000.0 - 10.0 * r0), 10.0)
            paths.append(write_raster(tmp_path / f"p{i}{j}.tif", image[:, r0:r1, c0:c1],
                                      tile=(64, 64), geotags=tags))
    return paths


def _here(run, image, output):
    """``seg-predict`` in this process (the console script's entry), its JSON result."""
    out = seg_predict_here(f"run={run}", f"image={image}", f"output={output}",
                           "tile_size=128", "preview=false")
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout[out.stdout.index("{"):])


def test_a_vrt_mosaic_predicts_as_its_scene_and_is_known_by_its_pieces(tmp_path):
    run = make_run(tmp_path / "run", make_model("same", levels=3, width=8))
    whole = make_image(tmp_path / "whole.tif", height=301, width=389)
    image = read_raster(whole)
    pieces = _pieces(tmp_path, image)
    vrt = write_vrt(pieces, tmp_path / "mosaic.vrt")
    a = _here(run, whole, tmp_path / "a.tif")
    b = _here(run, vrt, tmp_path / "b.tif")
    assert a["tiles"] == b["tiles_computed"] == b["tiles"] > 4
    assert read_raster(tmp_path / "b.tif").tobytes() == read_raster(tmp_path / "a.tif").tobytes()
    with rasterio.open(vrt) as v, rasterio.open(tmp_path / "b.tif") as out:
        assert (out.crs, out.transform, out.shape) == (v.crs, v.transform, v.shape)
    item = json.loads((tmp_path / "b.stac.json").read_text())
    source = [link for link in item["links"] if link["rel"] == "derived_from"]
    assert [(link["href"], link["type"]) for link in source] == [(str(vrt), "application/xml")]

    again = _here(run, vrt, tmp_path / "b.tif")
    assert again["tiles_computed"] == 0  # the same mosaic: the finished output is reused
    before, xml = input_id(vrt), vrt.read_bytes()
    changed = image[:, 150:, 201:].copy()
    changed[:, 5, 5] ^= 1  # one sample of one piece
    write_raster(pieces[3], changed, tile=(64, 64), overwrite=True,
                 geotags=RasterReader(pieces[3]).geotags)
    assert input_id(vrt) != before and vrt.read_bytes() == xml  # the VRT itself unchanged
    out = seg_predict_here(f"run={run}", f"image={vrt}", f"output={tmp_path / 'b.tif'}",
                           "tile_size=128", "preview=false")
    assert out.returncode != 0 and "was made by another prediction" in out.stderr
    out = seg_predict_here(f"run={run}", f"image={vrt}", f"output={pieces[2]}",
                           "overwrite=true")  # a piece of the mosaic being read
    assert out.returncode != 0 and out.stderr.strip().endswith(
        f"output '{pieces[2]}' is the image's file 3 '{pieces[2]}' (or holds it): writing it "
        "would destroy an input; choose another output path")
    assert read_raster(pieces[2]).tobytes() == image[:, 150:, :201].tobytes()
    size = pieces[1].stat().st_size
    with open(pieces[1], "r+b") as fh:  # a piece cut short: named before any work
        fh.truncate(size - 50)
    out = seg_predict_here(f"run={run}", f"image={vrt}", f"output={tmp_path / 'c.tif'}")
    assert out.returncode != 0 and out.stderr.strip().endswith(
        f"'{pieces[1]}' is truncated: its data ends at byte {size} but the file has "
        f"{size - 50} bytes. Re-copy or re-generate it.")
    assert not (tmp_path / "c.tif").exists() and not list(tmp_path.glob(".c.tif*"))


def test_bands_with_their_own_no_data_predict_with_nodata_and_are_refused_without(tmp_path):
    """Before: a raster whose bands carry different no-data values was refused at every
    opening, so the fix the refusal gives (``nodata=<value>``) was refused the same way."""
    run = make_run(tmp_path / "run", make_model("same", levels=3, width=8))
    whole = make_image(tmp_path / "whole.tif", height=121, width=137)
    image = read_raster(whole)
    image[:, 7:19, 30:41] = 0  # no data, in every band
    write_raster(whole, image, overwrite=True, geotags=RasterReader(whole).geotags)
    vrt = write_vrt([whole], tmp_path / "bands.vrt")
    text = vrt.read_text()
    assert "<NoDataValue>" not in text
    for band in range(image.shape[0]):  # band k's no-data value: k
        tag = f'<VRTRasterBand dataType="Byte" band="{band + 1}"'
        at = text.index(">", text.index(tag)) + 1
        text = text[:at] + f"<NoDataValue>{band}</NoDataValue>" + text[at:]
    vrt.write_text(text)
    out = seg_predict_here(f"run={run}", f"image={vrt}", f"output={tmp_path / 'a.tif'}")
    assert out.returncode == 2 and out.stderr.strip().endswith(
        f"'{vrt}' has a different no-data value per band (0.0, 1.0, 2.0, 3.0); pass "
        "nodata=<value> for all of them")
    got = seg_predict_here(f"run={run}", f"image={vrt}", f"output={tmp_path / 'b.tif'}",
                           "nodata=0", "preview=false")
    assert got.returncode == 0, got.stderr[-2000:]
    want = seg_predict_here(f"run={run}", f"image={whole}", f"output={tmp_path / 'c.tif'}",
                            "nodata=0", "preview=false")
    assert want.returncode == 0, want.stderr[-2000:]
    labels = read_raster(tmp_path / "b.tif")
    assert labels.tobytes() == read_raster(tmp_path / "c.tif").tobytes()
    assert ((labels[0] == 255) == (image == 0).all(0)).all()  # no data: every band at 0
    assert (labels[0, 7:19, 30:41] == 255).all()
