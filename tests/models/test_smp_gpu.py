"""The smp family on a GPU (`make test-gpu`): the CPU suite's exactness claims, on CUDA.

Tiles, stages and the file path (COG, two-pass statistics, staged maps in files) on
``cuda`` against the whole-image forward on the same device, fp32 with TF32 off (cuDNN
picks its own convolution algorithms per shape, so the tolerance is the CPU suite's 1e-5
of the largest logit), and tiled gradients in float64. The ``cpu`` variants are ``slow``:
``test_smp_exact.py``, ``test_smp_staged.py`` and ``test_smp_files.py`` prove the same on
the CPU in the default run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.prediction import make_image
from helpers.smp import TEST_PRESETS, assert_exact, preset_model
from test_gpu import ON_GPU, no_tf32  # noqa: F401  (autouse: TF32 off)
from test_smp_files import DATA, check_labels

from seg_at_scale.io import read_raster
from seg_at_scale.models.smp_stage_split import smp_stages
from seg_at_scale.prediction import PredictOptions, predict_raster
from seg_at_scale.tasks.losses import CrossEntropy
from seg_at_scale.tiling import extend, make_grid, predict_full
from seg_at_scale.tiling.staged import predict_staged
from seg_at_scale.tiling.statistic_passes import predict_tiled_exact, tiled_backward_exact

DEVICES = [pytest.param("cpu", id="cpu", marks=pytest.mark.slow), ON_GPU]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def dev(request: pytest.FixtureRequest) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if request.param == "cuda" \
        else torch.device("cpu")


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
@pytest.mark.parametrize("preset", TEST_PRESETS)
def test_smp_tiles_and_stages_equal_untiled_on_the_device(dev, preset):
    """Contiguous and channels_last tiles (FPN's GroupNorms and DeepLab's image pooling by
    their statistic passes), then every stage tiled: the untiled logits, 301 x 277."""
    net = preset_model(preset).to(dev)
    x = torch.randn(1, 4, 301, 277, device=dev)
    ref = predict_full(net, x).cpu()
    assert_exact(predict_tiled_exact(net, x, q=(2, 3)).cpu(), ref)
    nhwc = net.to(memory_format=torch.channels_last)
    assert_exact(predict_tiled_exact(nhwc, x, q=2, channels_last=True).cpu(), ref)
    eff: list[float] = []
    staged = predict_staged(smp_stages(nhwc), x, align=net.downsampling_factor,
                            budget=40_000, channels_last=True, efficiency=eff)
    assert sum(e > 1.0 for e in eff[:-1]) >= 2  # several stages ran as several tiles
    assert_exact(staged.cpu(), ref)


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
def test_smp_tiled_gradients_equal_whole_image_on_the_device(dev):
    """DeepLabV3+ (its image pooling a whole-image statistic) in float64, frozen BatchNorm."""
    net = preset_model("deeplabv3plus_test_resnet").double().to(dev)
    torch.manual_seed(1)
    x = torch.randn(1, 4, 333, 301, dtype=torch.float64, device=dev)
    target = torch.randint(0, 5, (1, 333, 301), device=dev)
    target[:, -17:] = 255
    loss = CrossEntropy(5).to(dev)
    s, w = loss(net(extend(x, net.footprint()))[..., :333, :301], target)
    (s / w).backward()
    whole = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad()
    value = tiled_backward_exact(net, x, target, loss, q=(2, 2))
    assert abs(float(value) - float(s.detach() / w)) < 1e-6
    worst = max(float((p.grad - whole[n]).abs().max()) for n, p in net.named_parameters())
    assert worst <= 1e-9 * max(float(g.abs().max()) for g in whole.values())


@pytest.mark.parametrize("dev", DEVICES, indirect=True)
@pytest.mark.parametrize("preset", ["fpn_test_resnet", "deeplabv3plus_test_resnet"])
def test_smp_file_paths_equal_untiled_on_the_device(dev, preset, tmp_path):
    """``predict_raster`` on the device, tiled (statistic passes over windows read from the
    file) and staged (maps in files): COGs equal the untiled forward, borders included."""
    net = preset_model(preset).to(dev)
    image = make_image(tmp_path / "scene.tif", height=389, width=461)
    x = torch.from_numpy(DATA(read_raster(image)))[None]
    ref = predict_full(net, x.to(dev)).cpu()
    fp = net.footprint()
    assert len(make_grid(389, 461, fp, q=3)) >= 4
    runs = {"tiled": PredictOptions(q=3, progress=False, preview=False),
            "staged": PredictOptions(staged=True, stage_memory_mb=1, progress=False,
                                     preview=False)}
    for name, options in runs.items():
        stats = predict_raster(net, image, tmp_path / f"{name}.tif", options, fp=fp,
                               normalizer=DATA)
        assert stats.statistics_s > 0 or name == "staged"
        pred = read_raster(tmp_path / f"{name}.tif")[0]
        assert pred.dtype == np.uint8
        check_labels(pred, ref)
