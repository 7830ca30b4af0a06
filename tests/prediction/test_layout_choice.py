"""``layout=auto``: the faster layout measured once per network shape and device, kept in
the user's cache, read back by later predictions; a broken or unwritable cache never stops
a prediction."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from seg_at_scale.models import UNet
from seg_at_scale.prediction import layout_choice
from seg_at_scale.prediction.options import PredictOptions

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def unet(width: int = 4) -> UNet:
    torch.manual_seed(0)
    return UNet(in_channels=4, num_classes=3, levels=2, base_width=width, padding="same").eval()


@pytest.fixture()
def timed(monkeypatch, tmp_path):
    """The cache in tmp_path; measurements counted and answered: contiguous is faster."""
    monkeypatch.setenv("SEG_AT_SCALE_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake(model, bands, side, autocast):
        calls.append((type(model).__name__, bands, side))
        return {"contiguous": 0.010, "channels_last": 0.020}

    monkeypatch.setattr(layout_choice, "measure_layouts", fake)
    return calls


def test_auto_is_measured_once_and_read_back(timed, tmp_path):
    net = unet()
    first = layout_choice.with_layout(PredictOptions(), net, 4)
    again = layout_choice.with_layout(PredictOptions(tile_size=96), net, 4)
    assert first.layout == again.layout == "contiguous" and not first.channels_last
    assert len(timed) == 1  # the second prediction read the cache
    entries = json.loads((tmp_path / "cache" / "layouts.json").read_text())
    assert [e["layout"] for e in entries.values()] == ["contiguous"]
    layout_choice.with_layout(PredictOptions(), unet(width=8), 4)  # another shape: measured
    assert len(timed) == 2
    assert layout_choice.with_layout(PredictOptions(layout="channels_last"), net, 4).layout \
        == "channels_last" and len(timed) == 2  # a layout asked for is not measured


def test_a_corrupt_cache_is_measured_again_and_rewritten(timed, tmp_path):
    path = tmp_path / "cache" / "layouts.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert layout_choice.with_layout(PredictOptions(), unet(), 4).layout == "contiguous"
    assert len(timed) == 1 and len(json.loads(path.read_text())) == 1


def test_an_unwritable_cache_measures_and_goes_on(timed, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SEG_AT_SCALE_CACHE", str(tmp_path / "file" / "below"))
    assert layout_choice.with_layout(PredictOptions(), unet(), 4).layout == "contiguous"
    assert layout_choice.with_layout(PredictOptions(), unet(), 4).layout == "contiguous"
    assert len(timed) == 2  # nothing kept: measured each time


def test_the_measurement_times_both_layouts_and_leaves_the_network_contiguous():
    net = unet()
    seconds = layout_choice.measure_layouts(net, 4, 64, None)
    assert set(seconds) == {"contiguous", "channels_last"}
    assert all(0 < s < 60 for s in seconds.values())
    conv = next(m for m in net.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous()


@pytest.mark.parametrize("native", [False, True])
def test_fast_runs_bf16_where_the_device_has_it_and_float32_where_bf16_is_emulated(
        native, tmp_path, monkeypatch, caplog):
    """Before: ``fast=true`` (the demo's prediction after training) autocast to bfloat16 on
    any CPU; on one with AVX2 alone, where oneDNN emulates it, the demo's U-Net ran a 512 px
    tile 10x (NHWC) to 170x (NCHW) slower than float32, and ``layout=auto`` spent minutes
    timing it. Without native bfloat16 the fast path is float32: the exact path's labels,
    byte for byte; with it, bfloat16 as before (labels that differ here and there)."""
    from helpers.prediction import make_image, make_model, make_run

    from seg_at_scale.io.zarr_raster import ZarrRaster
    from seg_at_scale.models.loading import load_trained
    from seg_at_scale.prediction import options as options_module
    from seg_at_scale.prediction.provenance import recorded_fingerprint
    from seg_at_scale.prediction.scene import predict_scene
    from seg_at_scale.tiling.geometry import Window

    monkeypatch.setenv("SEG_AT_SCALE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(options_module, "native_bf16", lambda device: native, raising=False)
    trained = load_trained(run=make_run(tmp_path / "run", make_model()))
    image = make_image(tmp_path / "a.tif", 131, 157)
    labels, precision = {}, {}
    with caplog.at_level(logging.INFO, "seg_at_scale.prediction.options"):
        for fast in (True, False):
            out = tmp_path / f"fast_{fast}.zarr"
            predict_scene(trained, image, out, PredictOptions(
                fast=fast, tile_size=64, layout="channels_last", preview=False, stac=False,
                progress=False))
            with ZarrRaster(out) as store:
                labels[fast] = store.read(Window(0, 0, 131, 157))
            precision[fast] = (recorded_fingerprint(out) or {}).get("autocast")
    emulated = "fast=true on a CPU without native bfloat16 kernels" in caplog.text
    assert precision[False] == "None" and emulated is not native
    if native:
        assert precision[True] == "torch.bfloat16"
        assert (labels[True] == labels[False]).mean() > 0.95
    else:
        assert precision[True] == "None"
        np.testing.assert_array_equal(labels[True], labels[False])
