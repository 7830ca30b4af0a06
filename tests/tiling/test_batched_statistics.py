"""Whole-image statistics held while a batch holds several tiles, and TTA refused for them.

A fixed statistic is one image's (``[1, C, 1, 1]``); a batch of tiles is ``[B, ...]``. Before
the fix, DeepLabV3+'s ASPP image pooling and Gated-SCNN's image pool concatenated a batch of
one with a batch of B (a raw ``RuntimeError`` whenever ``batch_size > 1`` grouped tiles, as
it does by default on a GPU). Test-time augmentation of such a model would run every view
with the plain image's statistics: not the TTA of the untiled image, so it is refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.prediction import make_image
from helpers.smp import preset_model

from seg_at_scale.models.gscnn import GSCNN


def tiny() -> GSCNN:
    torch.manual_seed(0)
    return GSCNN.from_preset("tiny", in_channels=4, num_classes=3)

from seg_at_scale.data.normalize import Normalizer  # noqa: E402
from seg_at_scale.errors import ConfigError  # noqa: E402
from seg_at_scale.io import read_raster, write_raster  # noqa: E402
from seg_at_scale.prediction import PredictOptions, predict_raster  # noqa: E402
from seg_at_scale.tiling import predict_full  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DATA = Normalizer(1 / 255, (0.5,) * 4, (0.25,) * 4)


def _by_batch(net: torch.nn.Module, image: Path, tmp_path: Path, tile_size: int,
              norm: Normalizer | None = None, sizes: tuple[int, ...] = (1, 4)
              ) -> dict[int, np.ndarray]:
    out = {}
    for bs in sizes:
        stats = predict_raster(net, image, tmp_path / f"b{bs}.tif",
                               PredictOptions(tile_size=tile_size, batch_size=bs,
                                              progress=False), normalizer=norm)
        if bs > 1:
            assert stats.batches < stats.tiles  # some batch held several tiles
        out[bs] = read_raster(tmp_path / f"b{bs}.tif")[0]
    return out


def test_deeplabv3plus_batches_of_tiles_equal_untiled(tmp_path):
    net = preset_model("deeplabv3plus_test_resnet")  # context 224: tiles of 576 px
    image = make_image(tmp_path / "scene.tif", height=389, width=733)
    labels = _by_batch(net, image, tmp_path, 576, DATA, sizes=(4,))
    ref = predict_full(net, torch.from_numpy(DATA(read_raster(image)))[None])[0]
    top2 = ref.topk(2, dim=0).values
    clear = ((top2[0] - top2[1]) > 1e-5 * ref.abs().max()).numpy()
    assert clear.mean() > 0.999 and np.unique(labels[4]).size > 1
    assert np.array_equal(labels[4][clear], ref.argmax(0).numpy()[clear])


def test_gscnn_image_pool_batches_of_tiles_equal_one_tile_at_a_time(tmp_path):
    net = tiny().eval()
    with torch.no_grad():
        net.aspp.pool.conv.weight.mul_(1000)  # labels that depend on the pooled mean
    raw = np.random.default_rng(3).integers(0, 256, (4, 517, 743)).astype(np.uint8)
    write_raster(tmp_path / "scene.tif", raw, tile=(64, 64))
    labels = _by_batch(net, tmp_path / "scene.tif", tmp_path, 520)
    assert np.array_equal(labels[4], labels[1]) and np.unique(labels[4]).size > 1


@pytest.mark.parametrize("which", ["deeplabv3plus", "fpn", "gscnn"])
def test_tta_of_a_model_with_whole_image_statistics_is_refused_before_work(tmp_path, which):
    net = tiny().eval() if which == "gscnn" else preset_model(f"{which}_test_resnet")
    image = make_image(tmp_path / "scene.tif", height=97, width=131)
    with pytest.raises(ConfigError, match=r"tta='flips': this model takes whole-image "
                                          r"statistics .*use tta=null"):
        predict_raster(net, image, tmp_path / "out.tif",
                       PredictOptions(tta="flips", progress=False), normalizer=DATA)
    assert list(tmp_path.iterdir()) == [image]  # nothing written
