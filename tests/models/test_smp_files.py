"""The file path: a COG predicted tile by tile equals the untiled forward, borders included,
with the normalisation the weights recorded (today's ``predict_raster`` API)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.prediction import make_image
from helpers.smp import lively, preset_model
from safetensors.torch import save_file

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.io import read_raster
from seg_at_scale.models.smp import SMPModel
from seg_at_scale.prediction import PredictOptions, predict_raster
from seg_at_scale.tiling import predict_full
from seg_at_scale.tiling.statistic_layers import statistic_sites

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DATA = Normalizer(1 / 255, (0.5,) * 4, (0.25,) * 4)


def normalizer_from(net: SMPModel) -> Normalizer:
    """The weights' mean/std where recorded, the data's elsewhere (what seg-train fills)."""
    norm = net.input_normalization()
    assert norm is not None
    mean = [m if m is not None else 0.5 for m in norm["mean"]]
    std = [s if s is not None else 0.25 for s in norm["std"]]
    return Normalizer(1 / 255, tuple(mean), tuple(std))


def check_labels(pred: np.ndarray, ref: torch.Tensor) -> None:
    """Labels equal wherever the reference is decided; the borders in full."""
    labels = ref.argmax(1)[0].numpy()
    top2 = ref.topk(2, dim=1).values[0]
    decided = ((top2[0] - top2[1]) > 1e-5 * ref.abs().max()).numpy()
    assert decided.mean() > 0.999 and np.unique(labels).size > 1
    np.testing.assert_array_equal(pred[decided], labels[decided])
    for edge in (np.s_[:8], np.s_[-8:], np.s_[:, :8], np.s_[:, -8:]):
        np.testing.assert_array_equal(pred[edge][decided[edge]], labels[edge][decided[edge]])


def test_unet_cog_equals_untiled_with_the_weights_normalisation(tmp_path):
    src = SMPModel("Unet", "tu-test_resnet", in_channels=3, num_classes=5,
                   options={"decoder_channels": [16, 16, 8, 8, 8]})
    torch.manual_seed(0)
    pretrained = {k: v.uniform_(0.5, 2) if k.endswith("running_var") else v.normal_()
                  for k, v in src.net.encoder.state_dict().items() if v.is_floating_point()}
    save_file(pretrained, tmp_path / "enc.safetensors", metadata={
        "mean": json.dumps([0.4, 0.5, 0.6]), "std": json.dumps([0.2, 0.3, 0.25])})
    net = lively(SMPModel("Unet", "tu-test_resnet", in_channels=4, num_classes=5,
                          options={"decoder_channels": [16, 16, 8, 8, 8]},
                          encoder_weights=str(tmp_path / "enc.safetensors")))
    norm = normalizer_from(net)
    assert norm.mean == (0.4, 0.5, 0.6, 0.5)
    image = make_image(tmp_path / "scene.tif", height=517, width=743)  # not multiples of 32
    fp = net.footprint()
    stats = predict_raster(net, image, tmp_path / "pred.tif",
                           PredictOptions(tile_size=2 * fp.context + 128, progress=False),
                           fp=fp, normalizer=norm)
    assert stats.tiles >= 6
    x = torch.from_numpy(norm(read_raster(image)))[None]
    check_labels(read_raster(tmp_path / "pred.tif")[0], predict_full(net, x))


def test_deeplabv3plus_cog_two_pass_equals_untiled(tmp_path):
    net = preset_model("deeplabv3plus_test_resnet")
    image = make_image(tmp_path / "scene.tif", height=389, width=461)
    fp = net.footprint()
    stats = predict_raster(net, image, tmp_path / "pred.tif",
                           PredictOptions(q=3, progress=False),
                           fp=fp, normalizer=DATA)
    assert stats.tiles >= 4 and stats.statistics_s > 0  # pass 1: the image pooling
    x = torch.from_numpy(DATA(read_raster(image)))[None]
    check_labels(read_raster(tmp_path / "pred.tif")[0], predict_full(net, x))


def test_fpn_cog_statistic_passes_in_the_raster_path_equal_untiled(tmp_path):
    """FPN's three GroupNorm levels: ``predict_raster`` runs their passes over windows read
    from the file, then the final pass with every statistic held (before this, each tile
    normalised by its own statistics)."""
    net = preset_model("fpn_test_resnet")
    image = make_image(tmp_path / "scene.tif", height=421, width=389)
    fp = net.footprint()
    stats = predict_raster(net, image, tmp_path / "pred.tif",
                           PredictOptions(q=3, progress=False),
                           fp=fp, normalizer=DATA)
    assert stats.tiles >= 4 and stats.statistics_s > 0
    assert all(s.fixed is None for _, s in statistic_sites(net))  # released afterwards
    x = torch.from_numpy(DATA(read_raster(image)))[None]
    check_labels(read_raster(tmp_path / "pred.tif")[0], predict_full(net, x))


@pytest.mark.parametrize("preset", ["deeplabv3plus_test_resnet", "fpn_test_resnet"])
def test_a_scene_that_fits_one_tile_runs_no_statistic_pass(tmp_path, preset):
    """One tile is the whole extended image: its own statistics are the untiled forward's,
    so the pass that computed them (the encoder over every tile) is skipped."""
    net = preset_model(preset)
    image = make_image(tmp_path / "scene.tif", height=233, width=301)
    stats = predict_raster(net, image, tmp_path / "pred.tif",
                           PredictOptions(tile_size=320, progress=False),
                           fp=net.footprint(), normalizer=DATA)
    assert stats.tiles == 1 and stats.statistics_s == 0
    x = torch.from_numpy(DATA(read_raster(image)))[None]
    check_labels(read_raster(tmp_path / "pred.tif")[0], predict_full(net, x))
