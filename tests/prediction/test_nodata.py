"""Non-finite samples are no data, whatever the nodata tag: 255 out, exact context around.

Before: NaN under a numeric nodata tag (-9999) and +-Inf without one reached the network;
the NaN area was predicted as class 0 and 11 % of a 22-px ring around it changed. NaN
without any tag was refused only when its tile was reached (47 of 48 tiles computed).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr
from helpers.prediction import make_model, seg_predict
from rasterio.enums import MaskFlags

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.io import example_geotags, read_raster, write_raster
from seg_at_scale.io.geotags import open_dataset
from seg_at_scale.prediction import PredictOptions, predict_raster
from seg_at_scale.tiling import make_grid, predict_full

NORM = Normalizer(1.0, (0.5,), (0.25,))


def _float_scene(tmp_path, tag: float | None):
    """517 x 743 float32, 4 bands: NaN blocks (one at the border, one inside), an Inf pixel
    in one band only, a -Inf pixel in a corner, and the tag's own value in one pixel."""
    rng = np.random.default_rng(3)
    yy, xx = np.mgrid[0:517, 0:743]
    img = np.stack([np.sin(yy / (9 + b)) * np.cos(xx / (13 + b)) for b in range(4)])
    img = (img * 0.4 + 0.5 + rng.normal(0, 0.05, img.shape)).astype(np.float32)
    img[:, 200:260, 300:371] = np.nan
    img[:, 0:40, 700:743] = np.nan
    img[2, 100, 100] = np.inf
    img[:, 516, 0] = -np.inf
    if tag is not None:
        img[:, 400, 50] = tag
    path = write_raster(tmp_path / "f.tif", img, tile=(64, 64), geotags=example_geotags(),
                        nodata=tag)
    invalid = ~np.isfinite(img).all(0)
    if tag is not None:
        invalid |= (img == tag).all(0)
    return path, img, invalid


def _reference(model, img, invalid):
    raw = np.where(invalid, 0, img)  # the no-data rule: samples zeroed, then normalised
    x = torch.from_numpy(NORM(raw))[None]
    with torch.no_grad():
        labels = predict_full(model, x).argmax(1)[0].numpy().astype(np.uint8)
    labels[invalid] = 255
    return labels


@pytest.mark.parametrize("tag", [None, -9999.0])
@pytest.mark.parametrize("padding", ["same", "valid"])
def test_non_finite_pixels_are_no_data_and_the_rest_equals_the_untiled_forward(
        tmp_path, one_torch_thread, tag, padding):
    model = make_model(padding, levels=3, width=4)
    path, img, invalid = _float_scene(tmp_path, tag)
    stats = predict_raster(model, path, tmp_path / "m.zarr",
                           PredictOptions(tile_size=96, progress=False), normalizer=NORM)
    got = zarr.open_group(tmp_path / "m.zarr", mode="r")["labels"][:]
    assert stats.tiles > 30 and stats.tiles_computed == stats.tiles
    np.testing.assert_array_equal(got, _reference(model, img, invalid))
    assert int((got == 255).sum()) == int(invalid.sum()) > 60 * 71


def test_nan_without_a_tag_is_predicted_through_the_command(tmp_path):
    """No refusal after 47 of 48 tiles: NaN is no data, through the whole command; the
    nodata=nan the old message suggested is accepted too."""
    from helpers.prediction import make_run
    from omegaconf import OmegaConf

    run = make_run(tmp_path / "run", make_model("same", levels=3, width=8))
    cfg = OmegaConf.load(run / "run_config.yaml")
    cfg.computed.input = {"dtype": "float32", "high": 1.0}
    cfg.data.scale = 1.0
    OmegaConf.save(cfg, run / "run_config.yaml")
    path, _, invalid = _float_scene(tmp_path, None)
    a = seg_predict(run, path, tmp_path / "a.tif", "ckpt=last", "fast=false", "tile_size=128")
    b = seg_predict(run, path, tmp_path / "b.tif", "ckpt=last", "fast=false", "tile_size=128",
                    "nodata=nan")
    assert a["tiles_computed"] == a["tiles"] == b["tiles_computed"]
    labels = read_raster(tmp_path / "a.tif")[0]
    np.testing.assert_array_equal(labels == 255, invalid)
    assert read_raster(tmp_path / "b.tif").tobytes() == labels.tobytes()


def test_tiles_wholly_in_no_data_are_written_and_the_run_completes(tmp_path, one_torch_thread):
    """A no-data margin covering whole tile cores (a scene's rotated footprint) is written
    as 255 and the COG completes; the store of such a run, rerun, is complete as it is.
    (zarr skips a chunk equal to its fill value unless told on every opening: those tiles
    were missing at the end and the run failed, and so did every rerun.)"""
    rng = np.random.default_rng(8)
    img = rng.integers(1, 255, (4, 301, 233)).astype(np.uint8)
    img[:, :170, :130] = 0  # the no-data tag: a third of the scene, from the corner
    path = write_raster(tmp_path / "s.tif", img, tile=(64, 64), geotags=example_geotags(),
                        nodata=0)
    invalid = (img == 0).all(0)
    model = make_model("same", levels=3, width=4)
    opts = PredictOptions(tile_size=96, probabilities="uint8", progress=False)
    stats = predict_raster(model, path, tmp_path / "m.tif", opts, normalizer=NORM)
    labels = read_raster(tmp_path / "m.tif")[0]
    np.testing.assert_array_equal(labels, _reference(model, img.astype(np.float32), invalid))
    probs = read_raster(tmp_path / "m_probabilities.tif")
    assert int(probs[:, invalid].max()) == 0 and int(probs[:, ~invalid].sum(0).min()) >= 250
    # GDAL's internal mask hides them (no value can: 0 is a probability); before, none
    with open_dataset(tmp_path / "m_probabilities.tif") as ds:
        assert all(f == [MaskFlags.per_dataset] for f in ds.mask_flag_enums)
        np.testing.assert_array_equal(ds.read_masks(1), np.where(invalid, 0, 255))
        assert ds.tags(ns="IMAGE_STRUCTURE")["LAYOUT"] == "COG"
    full = write_raster(tmp_path / "full.tif", np.maximum(img, 1), tile=(64, 64))
    predict_raster(model, full, tmp_path / "f.tif", opts, normalizer=NORM)
    with open_dataset(tmp_path / "f_probabilities.tif") as ds:  # no data: no mask
        assert all(f == [MaskFlags.all_valid] for f in ds.mask_flag_enums)
    assert stats.tiles_computed == stats.tiles > 20
    cores = [t.core for t in make_grid(301, 233, model.footprint(), tile_size=96).tiles]
    assert sum(bool(invalid[c.row : c.row_end, c.col : c.col_end].all()) for c in cores) >= 4
    # one count per class of the model, no data not counted; the same from a reused output
    # (it held 255 counts, one per byte value, through the Python API)
    counts = np.bincount(labels[~invalid], minlength=model.num_classes).tolist()
    assert stats.class_pixels == counts and len(counts) == model.num_classes
    assert predict_raster(model, path, tmp_path / "m.tif", opts,
                          normalizer=NORM).class_pixels == counts
    store = tmp_path / "m.zarr"
    first = predict_raster(model, path, store, opts, normalizer=NORM)
    empty = sum(1 for p in (store / "labels" / "c").rglob("*") if p.is_file())
    assert first.tiles_computed == first.tiles == empty  # every chunk, the empty ones too
    again = predict_raster(model, path, store, opts, normalizer=NORM)
    assert again.reused and again.tiles_computed == 0
    assert first.class_pixels == again.class_pixels == counts
