"""UResNet: shapes, shared plane weights, flat layer form, halo, exact tiling."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from seg_at_scale.errors import ConfigError
from seg_at_scale.models import URESNET_SIZES, UResNet
from seg_at_scale.models.layers import check_layers, run_layers
from seg_at_scale.models.uresnet import plane_view
from seg_at_scale.tasks.cosmic import CosmicLoss
from seg_at_scale.tiling import (
    extend,
    predict_full,
    predict_tiled,
    tiled_backward,
    whole_image_batch_norm,
)
from seg_at_scale.tiling.halo import empirical_halo


def lively(net: UResNet, seed: int = 0) -> UResNet:
    """Variance-keeping weights and non-trivial batch-norm statistics (eval mode)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, (torch.nn.Conv2d, torch.nn.ConvTranspose2d)):
                fan = m.weight[0].numel() if isinstance(m, torch.nn.Conv2d) else m.weight.shape[0]
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * (2 / fan) ** 0.5)
                if m.bias is not None:
                    m.bias.uniform_(-0.5, 0.5, generator=g)
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2, generator=g)
                m.running_var.uniform_(0.5, 2.0, generator=g)
                m.weight.uniform_(0.5, 1.5, generator=g)
                m.bias.uniform_(-0.2, 0.2, generator=g)
    return net.eval()


def tiny(**kw) -> UResNet:
    return UResNet(**{**URESNET_SIZES["tiny"].kwargs(), **kw})


def test_shapes_layout_and_plane_view():
    net = lively(tiny(num_classes=3))
    x = torch.randn(2, 3, 40, 56)
    y = net(x)
    assert y.shape == (2, 9, 40, 56)
    v = plane_view(y, 3)
    assert v.shape == (2, 3, 3, 40, 56)
    assert torch.equal(v[1, 2, 0], y[1, 2])          # plane 0, class 2 -> channel 2
    assert torch.equal(v[0, 1, 2], y[0, 2 * 3 + 1])  # plane 2, class 1 -> channel 7


def test_planes_share_weights_and_meet_only_in_the_deepest_block():
    torch.manual_seed(0)
    net = lively(tiny(batch_norm=False))
    x = torch.randn(1, 3, 32, 32)
    swapped = x[:, [1, 0, 2]]
    y, ys = plane_view(net(x), 3), plane_view(net(swapped), 3)
    # the joint block mixes planes, so swapping two planes is not a mere relabelling ...
    assert not torch.allclose(ys[:, :, 0], y[:, :, 1], atol=1e-4)
    # ... but with the joint block's output switched off planes are independent
    with torch.no_grad():
        net.deepest[-2][0].weight.zero_()
        net.deepest[-2][0].bias.zero_()
    y, ys = plane_view(net(x), 3), plane_view(net(swapped), 3)
    assert torch.allclose(ys[:, :, 0], y[:, :, 1], atol=1e-6)
    assert torch.allclose(ys[:, :, 1], y[:, :, 0], atol=1e-6)


def test_growth_and_cosmic_preset():
    assert tiny(growth="additive", initial_filters=4).widths == [4, 8, 12]
    assert tiny(growth="multiplicative", initial_filters=4).widths == [4, 8, 16]
    net = UResNet(**URESNET_SIZES["cosmic"].kwargs())
    assert (net.depth, net.widths[0], net.blocks_per_layer) == (6, 16, 2)
    assert net.footprint().align == 32 and net.footprint().halo == 606


CONFIGS = list(itertools.product(["concat", "sum", "none"], ["max_pool", "strided_conv"],
                                 ["interpolation", "transpose"]))


@pytest.mark.parametrize("connections,downsample,upsample", CONFIGS)
def test_pipeline_layers_equal_forward_and_halo_probe_agrees(connections, downsample, upsample):
    torch.manual_seed(1)
    net = lively(tiny(connections=connections, downsample=downsample, upsample=upsample,
                      batch_norm=(downsample == "max_pool"), growth="multiplicative"))
    layers = net.pipeline_layers()
    check_layers(layers)
    x = torch.randn(2, 3, 36, 44)
    assert torch.equal(run_layers(layers, x), net(x))
    assert empirical_halo(net) == net.footprint().halo


def test_halo_probe_agrees_on_deeper_nets():
    net = UResNet(**URESNET_SIZES["small"].kwargs(), initial_kernel=3, deepest_kernel=5)
    assert empirical_halo(net) == net.footprint().halo


@pytest.mark.parametrize("q", [2, 3, (2, 4)])
@pytest.mark.parametrize("batch_norm", [False, True])
def test_tiled_prediction_equals_untiled_on_203x171(q, batch_norm):
    torch.manual_seed(2)
    net = lively(UResNet(**URESNET_SIZES["small"].kwargs(), batch_norm=batch_norm), seed=3)
    x = torch.randn(1, 3, 203, 171)
    ref, tiled = predict_full(net, x), predict_tiled(net, x, q=q)
    assert tiled.shape == (1, 9, 203, 171)
    assert (tiled - ref).abs().max() <= 1e-5 * ref.abs().max()
    labels = plane_view(ref, 3).argmax(1)
    assert labels.unique().numel() == 3
    assert torch.equal(plane_view(tiled, 3).argmax(1), labels)


@pytest.mark.parametrize("balance", ["light", "even", "focal"])
def test_tiled_gradient_equals_whole_image_gradient(balance):
    torch.manual_seed(3)
    net = lively(tiny(batch_norm=False)).double().train()
    x = torch.randn(1, 3, 61, 83, dtype=torch.float64)
    target = torch.randint(0, 3, (1, 3, 61, 83))
    target[0, 1, :5] = 255
    loss = CosmicLoss(3, 3, balance).frozen(target)  # even: weights of the whole image
    tiled_backward(net, x, target, loss, q=(3, 2))
    tiled = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    logits = net(extend(x, net.footprint()))[..., :61, :83]
    s, w = loss(logits, target)
    (s / w).backward()
    for a, b in zip(tiled, net.parameters()):
        assert torch.allclose(a, b.grad, rtol=1e-9, atol=1e-12)


def test_train_mode_batch_norm_sees_tile_statistics_so_tiled_prediction_refuses_it():
    """Documented limitation: train-mode batch norm sees tile statistics (docs/design.md): a
    tile's core run anyway is not the whole image's, and predict_tiled refuses the network."""
    from seg_at_scale.tiling import make_grid
    from seg_at_scale.tiling.predict import run_tile

    torch.manual_seed(4)
    net = lively(tiny(batch_norm=True)).train()
    x = torch.randn(1, 3, 64, 96)
    fp = net.footprint()
    tile = make_grid(64, 96, fp, q=2).tiles[0]
    with torch.no_grad():
        ref = net(x)[..., tile.core.row : tile.core.row_end, tile.core.col : tile.core.col_end]
        core = run_tile(net, x, tile, fp)
    assert (core - ref).abs().max() > 1e-3 * ref.abs().max()
    with pytest.raises(ConfigError, match=r"is in training mode.*call model.eval\(\) first"):
        predict_tiled(net, x, q=2)


@pytest.mark.parametrize("q", [2, (3, 2)])
def test_two_pass_batch_norm_makes_tiles_equal_the_train_mode_whole_image(q):
    torch.manual_seed(5)
    net = lively(tiny(batch_norm=True)).train()
    x = torch.randn(2, 3, 61, 83) * 2 + 1
    with torch.no_grad():  # the untiled train-mode forward (batch statistics of the image)
        ref = copy.deepcopy(net)(extend(x, net.footprint()))[..., :61, :83]
    passes = whole_image_batch_norm(net, [x], q=q)
    assert passes == sum(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules())
    assert not net.training
    tiled = predict_tiled(net, x, q=q)
    assert (tiled - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_bad_arguments_name_key_and_fix():
    with pytest.raises(ConfigError, match="model.connections='add'.*concat, sum, none"):
        tiny(connections="add")
    with pytest.raises(ConfigError, match="model.depth=1"):
        tiny(depth=1)
    with pytest.raises(ConfigError, match="model.initial_kernel=4 must be odd"):
        tiny(initial_kernel=4)
    with pytest.raises(ValueError, match="not a multiple of its downsampling factor 4"):
        tiny()(torch.zeros(1, 3, 30, 32))
    with pytest.raises(ValueError, match=r"expects planes \[B, 3, H, W\]"):
        tiny()(torch.zeros(1, 2, 32, 32))


def test_the_documented_python_path_for_planes_equals_the_whole_event(tmp_path):
    """docs/models.md's lines for predicting events (which seg-predict refuses): labels per
    plane equal the untiled network's, with the run's normalisation, on tiles of 48."""
    import re
    import textwrap
    from pathlib import Path

    import numpy as np
    from helpers.prediction import make_planes_run

    from seg_at_scale.io import write_raster

    doc = (Path(__file__).parents[2] / "docs" / "models.md").read_text()
    block = next(textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", doc, re.S)
                 if "plane_view(logits" in b)
    run, net = make_planes_run(tmp_path / "run", depth=3, mean=0.5, std=2.0)
    event = np.random.default_rng(0).random((3, 75, 131)).astype(np.float32) * 300
    image = write_raster(tmp_path / "event_image.tif", event)
    tile = f"tile_size={2 * net.footprint().halo + 32}"
    code = (block.replace("runs/cosmic/<date>", str(run))
            .replace('"event_image.tif"', repr(str(image))).replace("tile_size=512", tile))
    assert code.count(str(run)) == 1 and code.count(tile) == 1
    scope: dict = {}
    exec(compile(code, "docs/models.md", "exec"), scope)  # noqa: S102 - the doc's own lines
    x = (torch.from_numpy(event) * 0.02 - 0.5) / 2.0
    from seg_at_scale.tiling.predict import predict_full

    with torch.inference_mode():  # the whole event at once (padded to the alignment)
        whole = plane_view(predict_full(net, x[None]), 3).argmax(1)[0]
    assert scope["labels"].shape == (3, 75, 131)
    assert torch.equal(scope["labels"], whole)
    assert len(whole.unique()) > 1
