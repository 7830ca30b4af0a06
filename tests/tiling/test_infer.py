"""``tiling.infer``, the one entry for predicting a tensor tiled: it picks the exact method
the network allows, equals the untiled forward at sizes that are not multiples of the
alignment, and refuses in one line what a network cannot do exactly."""

from __future__ import annotations

import pytest
import torch

from seg_at_scale.errors import ConfigError
from seg_at_scale.models import UNet
from seg_at_scale.models.gscnn import GSCNN
from seg_at_scale.models.smp import SMPModel
from seg_at_scale.tiling import infer, predict_full
from seg_at_scale.tiling.geometry import Footprint
from seg_at_scale.tiling.infer import choose_method

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def unet(**kw) -> UNet:
    torch.manual_seed(0)
    return UNet(in_channels=4, num_classes=3, levels=3, base_width=4, **kw).eval()


@pytest.mark.parametrize("padding", ["same", "valid"])
@pytest.mark.parametrize("tiling", [{"q": 2}, {"q": (3, 2)}, {"tile_size": 64}])
def test_auto_tiles_equal_the_untiled_forward_at_odd_sizes(padding, tiling):
    net = unet(padding=padding)
    x = torch.randn(1, 4, 101, 87)
    ref = predict_full(net, x)
    assert torch.equal(infer(net, x), ref)  # no grid: the untiled forward itself
    assert (infer(net, x, **tiling) - ref).abs().max() < 1e-5
    assert infer(net, x[0], **tiling).shape == ref.shape[1:]  # unbatched in, unbatched out


def test_statistic_sites_take_the_passes_and_plain_tiles_are_refused():
    torch.manual_seed(0)
    net = SMPModel("FPN", "tu-test_resnet", 4, 5, options={
        "decoder_pyramid_channels": 32, "decoder_segmentation_channels": 32}).eval()
    assert choose_method(net, tiled=True) == "passes"
    x = torch.randn(1, 4, 197, 229)
    ref = predict_full(net, x)
    assert (infer(net, x, q=2) - ref).abs().max() < 1e-4
    with pytest.raises(ConfigError, match=r"GroupNormSite.*predict_tiled_exact"):
        infer(net, x, q=2, method="tiled")


def test_two_pass_pooling_is_chosen_for_gated_scnn_and_plain_tiles_refused():
    torch.manual_seed(0)
    net = GSCNN.from_preset("tiny", in_channels=4, num_classes=3).eval()
    with torch.no_grad():
        net.aspp.pool.conv.weight.mul_(30)  # make the pooled branch matter
    assert choose_method(net, tiled=True) == "two_pass"
    x = torch.randn(1, 4, 301, 277)
    ref = predict_full(net, x)
    assert (infer(net, x, q=2) - ref).abs().max() < 1e-4
    with pytest.raises(ConfigError, match=r"pools over its whole input.*two_pass"):
        infer(net, x, q=2, method="tiled")


def plain_group_norm() -> torch.nn.Module:
    """A network with a GroupNorm the project has not made a statistic site."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.GroupNorm(2, 8),
                               torch.nn.Conv2d(8, 3, 1)).eval()


@pytest.mark.parametrize("make, match", [
    (plain_group_norm, r"GroupNorm\) computes over the whole input"),
    (lambda: unet(norm="batch").train(), r"BatchNorm2d\) is in training mode.*model.eval"),
])
def test_layers_that_see_the_tile_are_refused_tiled_but_run_untiled(make, match):
    net = make()
    x = torch.randn(1, 4, 61, 53)
    fp = None if isinstance(net, UNet) else Footprint(1, 1, "same", 0)  # its convolutions'
    with pytest.raises(ConfigError, match=match):
        infer(net, x, q=2, fp=fp)
    assert infer(net, x, fp=fp).shape == (1, 3, 61, 53)


@pytest.mark.parametrize("q", [2, 3])
def test_a_group_norm_unet_is_tiled_exactly_by_statistic_passes(q):
    """Its GroupNorms are statistic sites: tiled, each sees the whole image's statistics."""
    net = unet(norm="group", padding="same")
    x = torch.randn(1, 4, 203, 171)
    assert choose_method(net, tiled=True) == "passes"
    ref = predict_full(net, x)
    tiled = infer(net, x, q=q)
    assert (tiled - ref).abs().max() < 1e-5 and torch.equal(tiled.argmax(1), ref.argmax(1))
    with pytest.raises(ConfigError, match=r"model.norm='group' with model.padding='valid'"):
        unet(norm="group", padding="valid")


def test_bad_methods_and_options_are_refused_in_one_line():
    net, x = unet(), torch.randn(1, 4, 61, 53)
    with pytest.raises(ConfigError, match=r"method='sliding' is not one of auto, untiled"):
        infer(net, x, method=str("sliding"))  # noqa: UP018 (not a Method literal, on purpose)
    with pytest.raises(ConfigError, match=r"method='tiled' tiles the image: give q or tile_size"):
        infer(net, x, method="tiled")
    with pytest.raises(ConfigError, match=r"'blended' takes one int tile_size"):
        infer(net, x, method="blended", q=2)
    with pytest.raises(ConfigError, match=r"'blended' needs a same-padding network"):
        infer(unet(padding="valid"), x, method="blended", tile_size=32)


def test_blended_is_only_run_when_named_and_is_not_exact():
    net = plain_group_norm()  # a network tiles cannot compute exactly
    x = torch.randn(1, 4, 96, 96)
    fp = Footprint(1, 1, "same", 0)  # its convolutions'
    ref = predict_full(net, x, fp)
    approx = infer(net, x, method="blended", tile_size=48, overlap=0.5, fp=fp)
    assert approx.shape == ref.shape
    assert (approx - ref).abs().max() > 1e-4  # an approximation, as its name says
