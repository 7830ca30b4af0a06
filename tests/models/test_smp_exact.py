"""The smp family tiles exactly: presets, alignment and halo found, tiled == untiled."""

from __future__ import annotations

import pytest
import torch
from helpers.smp import ALL_PRESETS, TEST_PRESETS, assert_exact, model_node, preset_model
from segmentation_models_pytorch.decoders.deeplabv3.decoder import ASPP

from seg_at_scale.errors import ConfigError
from seg_at_scale.models.registry import build_model
from seg_at_scale.models.smp import SMPModel
from seg_at_scale.tasks.losses import CrossEntropy
from seg_at_scale.tiling import make_grid, predict_full
from seg_at_scale.tiling.statistic_passes import predict_tiled_exact, tiled_backward_exact
from seg_at_scale.tiling.statistics import predict_tiled_two_pass

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (preset, alignment, statistic passes): Unet none, FPN three GroupNorm levels, DeepLabV3+ one
GEOMETRY = {"unet_test_resnet": (32, 0), "fpn_test_resnet": (32, 3),
            "deeplabv3plus_test_resnet": (16, 1)}


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_every_preset_composes_into_the_registry(preset):
    node = model_node(preset, bands=6, classes=3)
    assert node["_target_"] == "seg_at_scale.models.SMPModel"
    assert (node["in_channels"], node["num_classes"]) == (6, 3)
    if "test" in preset:  # the large ones build in seconds, their footprint in tens
        net = build_model(node, where="test").eval()
        assert net(torch.zeros(1, 6, 64, 96)).shape == (1, 3, 64, 96)


@pytest.mark.parametrize("preset", TEST_PRESETS)
def test_alignment_and_statistic_levels_found(preset):
    net = preset_model(preset)
    align, levels = GEOMETRY[preset]
    fp = net.footprint()
    assert (fp.align, fp.padding, net.statistic_levels()) == (align, "same", levels)
    assert 0 < fp.halo < 400


@pytest.mark.parametrize("tiling", ["tile_size", "q"])
@pytest.mark.parametrize("preset", TEST_PRESETS)
def test_tiled_equals_untiled_at_odd_size(preset, tiling):
    net = preset_model(preset)
    fp = net.footprint()
    # cores of 8 alignments: the smallest (4) tiles these contexts (160-224 px) ~2x slower for
    # the same cases
    tile = 2 * fp.context + 8 * fp.align
    tiling = {"tile_size": tile} if tiling == "tile_size" else {"q": (2, 3)}
    # no side a multiple of 32 (the grid reaches past it); past 2 (tile - context), so
    # tile_size gives inner tiles reading their context on all four sides
    h, w = (2 * (tile - fp.context) + 37, 2 * (tile - fp.context) + 5) if "tile_size" in tiling \
        else (461, 389)
    x = torch.randn(1, 4, h, w)
    grid = make_grid(h, w, fp, **tiling)
    assert min(grid.shape) >= (3 if "tile_size" in tiling else 2)
    if "tile_size" in tiling:
        assert any(0 < t.read.row and t.read.row + t.read.height < h and 0 < t.read.col
                   and t.read.col + t.read.width < w for t in grid.tiles)
    assert_exact(predict_tiled_exact(net, x, **tiling), predict_full(net, x))


def test_an_unbatched_image_and_a_nested_pass_as_predict_tiled_takes_them():
    """``[C, H, W]`` is accepted as by ``predict_tiled`` (was: the height read as channels, a
    raw RuntimeError); passes run inside ``fixed_statistics`` are refused in one line (was:
    a raw KeyError)."""
    from seg_at_scale.tiling.statistic_passes import fixed_statistics, tensor_tiles

    net = preset_model("fpn_test_resnet")
    x = torch.randn(4, 197, 229)
    ref = predict_full(net, x[None])[0]
    assert_exact(predict_tiled_exact(net, x, q=2)[None], ref[None])
    grid = make_grid(197, 229, net.footprint(), q=2)
    with fixed_statistics(net, tensor_tiles(x[None], grid), grid), \
            pytest.raises(ValueError, match=r"already hold a statistic .*outside it"):
        predict_tiled_exact(net, x, q=2)


def test_statistic_sites_in_a_valid_padding_network_are_refused():
    """The passes map a tile's core onto a site's map by its stride alone, which a network
    that shrinks its input breaks: refused in one line rather than wrong."""
    from seg_at_scale.tiling.statistic_layers import GroupNormSite

    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), GroupNormSite(2, 4),
                              torch.nn.Conv2d(4, 2, 1)).eval()
    with pytest.raises(ConfigError, match="same-padding networks only"):
        predict_tiled_exact(net, torch.randn(1, 1, 61, 53), q=2)


def test_deeplab_two_pass_protocol_equals_untiled():
    """DeepLabV3+ also offers the single image-pooling pass the raster path runs."""
    net = preset_model("deeplabv3plus_test_resnet")
    x = torch.randn(1, 4, 333, 301)
    assert_exact(predict_tiled_two_pass(net, x, tile_size=480), predict_full(net, x))


def test_fpn_refuses_the_single_pooling_pass():
    net = preset_model("fpn_test_resnet")
    with pytest.raises(ConfigError, match="need one pass per level"):
        net.pooled_features(torch.zeros(1, 4, 64, 64))


@pytest.mark.parametrize("encoder,size,options", [
    ("tu-test_convnext", (1181, 1093), {"decoder_channels": [16, 16, 8, 8, 8]}),
    ("resnet18", (653, 617), {"decoder_channels": [32, 16, 16, 8, 8]}),
])
def test_convnext_and_resnet18_unets_tiled_equal_untiled(encoder, size, options):
    """LayerNorm over channels, GELU, 7 x 7 depthwise (ConvNeXt); torchvision's ResNet."""
    torch.manual_seed(3)
    net = SMPModel("Unet", encoder, in_channels=3, num_classes=4, options=options)
    from helpers.smp import lively

    net = lively(net)
    x = torch.randn(1, 3, *size)
    assert len(make_grid(*size, net.footprint(), q=2)) == 4
    assert_exact(predict_tiled_exact(net, x, q=2), predict_full(net, x))


@pytest.mark.parametrize("preset", TEST_PRESETS)
def test_tiled_gradients_equal_whole_image_gradients(preset):
    net = preset_model(preset).double()  # eval: BatchNorm frozen, as fine-tuning runs it
    torch.manual_seed(1)
    x = torch.randn(1, 4, 397, 363, dtype=torch.float64)
    target = torch.randint(0, 5, (1, 397, 363))
    target[:, :20] = 255  # ignored pixels count nowhere
    loss = CrossEntropy(5)
    fp = net.footprint()
    ext = make_grid(397, 363, fp, q=1).extended
    from seg_at_scale.tiling import extend

    logits = net(extend(x, fp))[..., :397, :363]
    s, w = loss(logits, target)
    (s / w).backward()
    whole = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad()
    value = tiled_backward_exact(net, x, target, loss, q=(2, 2))
    assert ext.height % fp.align == 0
    assert abs(float(value) - float(s.detach() / w)) < 1e-6  # returned as float32
    worst = max(float((p.grad - whole[n]).abs().max()) for n, p in net.named_parameters())
    scale = max(float(g.abs().max()) for g in whole.values())
    assert worst <= 1e-9 * scale


@pytest.mark.parametrize("preset", ["unet_test_resnet", "fpn_test_resnet", "deeplab_rate_8"])
def test_channels_last_fp32_tiles_equal_the_contiguous_whole_image(preset):
    """The fast fp32 layout keeps exactness: NHWC tiles against the NCHW untiled forward
    (DeepLabV3+ at rates >= 8: its ASPP depthwise convolutions compute in NCHW)."""
    from seg_at_scale.tiling.layout import NCHWBlock

    net = (preset_model("deeplabv3plus_test_resnet", "model.options.decoder_atrous_rates=[8,9,10]")
           if preset == "deeplab_rate_8" else preset_model(preset))
    assert sum(isinstance(m, NCHWBlock) for m in net.modules()) == (
        3 if preset == "deeplab_rate_8" else 0)
    x = torch.randn(1, 4, 301, 277)
    ref = predict_full(net, x)
    nhwc = net.to(memory_format=torch.channels_last)
    assert_exact(predict_tiled_exact(nhwc, x, q=2, channels_last=True), ref)


def test_statistics_from_shares_of_the_tiles_reduced_equal_one_process():
    """Two processes each pass half of the tiles; ``reduce`` adds the other's sums (as
    ``all_reduce`` would): the statistic equals one process's (one level: DeepLabV3+)."""
    from seg_at_scale.tiling.statistic_passes import statistic_passes, tensor_tiles

    net = preset_model("deeplabv3plus_test_resnet")
    x = torch.randn(1, 4, 333, 301)
    grid = make_grid(333, 301, net.footprint(), q=2)
    tiles = list(tensor_tiles(x, grid)())
    ((sites, _),) = statistic_passes(net, lambda: iter(tiles), grid)
    ref = sites[0].fixed.clone()
    sites[0].fixed = None
    ((_, other),) = statistic_passes(net, lambda: iter(tiles[1::2]), grid)
    sites[0].fixed = None
    statistic_passes(net, lambda: iter(tiles[0::2]), grid,
                     reduce=lambda t: t + other[id(sites[0])])
    share_alone = sites[0].statistic(other[id(sites[0])]).float()
    assert not torch.allclose(share_alone, ref, rtol=0, atol=1e-4)  # a share is not the whole
    assert torch.allclose(sites[0].fixed, ref, rtol=0, atol=1e-6)


def test_deeplab_statistic_pass_stops_before_the_aspp_convolutions(monkeypatch):
    """ASPP computes its image pooling first (same output), so a statistic pass, which stops
    at the pooling, runs none of the four convolution branches (was: all four per tile)."""
    import seg_at_scale.tiling.statistic_passes as passes

    net = preset_model("deeplabv3plus_test_resnet")
    x = torch.randn(1, 4, 333, 301)
    grid = make_grid(333, 301, net.footprint(), q=2)
    aspp = net.net.decoder.aspp[0]
    calls: list[int] = []
    for i, branch in enumerate(aspp.convs[:4]):
        branch.register_forward_hook(lambda *_, i=i: calls.append(i))

    def levels(*args):  # the sites' probe runs the whole network once: not a pass
        found = real(*args)
        calls.clear()
        return found

    real = passes._levels
    monkeypatch.setattr(passes, "_levels", levels)
    done = passes.statistic_passes(net, passes.tensor_tiles(x, grid), grid)
    assert len(done) == 1 and calls == []
    for sites, _ in done:
        for site in sites:
            site.fixed = None
    y = predict_full(net, x)
    assert sorted(set(calls)) == [0, 1, 2, 3]
    reordered = type(aspp)
    aspp.__class__ = ASPP  # smp's own forward, branch by branch in order
    try:
        ref = predict_full(net, x)
    finally:
        aspp.__class__ = reordered
    assert torch.equal(y, ref)


def test_plain_predict_tiled_refuses_statistic_sites_it_would_tile_inexactly():
    """The trap: ``predict_tiled`` on FPN's GroupNorm sites computed each tile's statistic
    and returned logits far from the untiled ones with no warning. It now refuses in one
    line naming the site and the exact entry; the exact entry equals the untiled forward,
    and one tile (the untiled forward itself) is still allowed."""
    from seg_at_scale.tiling import predict_tiled

    net = preset_model("fpn_test_resnet")
    x = torch.randn(1, 4, 197, 229)
    with pytest.raises(ConfigError, match=r"GroupNormSite\) that a tile alone cannot.*"
                                          r"predict_tiled_exact"):
        predict_tiled(net, x, q=2)
    ref = predict_full(net, x)
    assert_exact(predict_tiled_exact(net, x, q=2), ref)
    assert_exact(predict_tiled(net, x, q=1), ref)
