"""``layout=auto``: the faster layout measured once per network shape and device, kept in
the user's cache, read back by later predictions; a broken or unwritable cache never stops
a prediction."""

from __future__ import annotations

import json

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
