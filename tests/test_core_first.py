"""A block computing only a tile's core (``tiling.core``) == the block cropped to it."""

from __future__ import annotations

import pytest
import torch
from segmentation_models_pytorch.decoders.deeplabv3.decoder import ASPPConv, ASPPSeparableConv
from torch import nn

from seg_at_scale.models.layout import NCHWBlock, prefer_layouts
from seg_at_scale.tiling.core import computes_core, core_of


def _lively(block: nn.Module) -> nn.Module:
    """BatchNorm statistics that are not the identity, then eval."""
    torch.manual_seed(1)
    for m in block.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return block.eval()


CROPS = [  # (rows, cols) of a 45 x 38 window: inside, at each edge, the whole of it
    (slice(12, 31), slice(12, 25)), (slice(0, 19), slice(7, 38)), (slice(26, 45), slice(0, 9)),
    (slice(0, 45), slice(0, 38)), (slice(3, 4), slice(37, 38)),
]


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("kind", ["separable_nchw_block", "separable", "full", "rectangular"])
def test_the_core_equals_the_block_cropped(kind, layout):
    """Odd window, crops at every edge (where the padding's zeros are read) and inside;
    DeepLabV3+'s separable branch also as the NCHW block ``prefer_layouts`` makes of it."""
    torch.manual_seed(0)
    if kind.startswith("separable"):
        block = ASPPSeparableConv(6, 5, dilation=12)
    elif kind == "full":
        block = ASPPConv(6, 5, dilation=7)
    else:
        block = nn.Sequential(nn.Conv2d(6, 4, (3, 5), padding=(2, 6), dilation=(2, 3)),
                              nn.BatchNorm2d(4), nn.SiLU(), nn.Conv2d(4, 3, 1))
    block = _lively(block)
    if kind == "separable_nchw_block":
        assert prefer_layouts(block) == 1 and isinstance(block, NCHWBlock)
    assert computes_core(block)
    x = torch.randn(2, 6, 45, 38)
    if layout == "channels_last":
        block, x = block.to(memory_format=torch.channels_last), x.contiguous(
            memory_format=torch.channels_last)
    with torch.no_grad():
        whole = block(x)
        for rows, cols in CROPS:
            y = core_of(block, x, rows, cols)
            ref = whole[..., rows, cols]
            assert y.shape == ref.shape
            torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
            fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
            assert y.is_contiguous(memory_format=fmt)  # the input's layout, as the block


@pytest.mark.parametrize("block", [
    nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1)),
    nn.Sequential(nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.ReLU()),
    nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"), nn.ReLU()),
    nn.Sequential(nn.Conv2d(4, 4, 3, padding="same"), nn.ReLU()),
    nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4).train()),
    nn.Sequential(nn.BatchNorm2d(4).eval(), nn.Conv2d(4, 4, 3, padding=1)),
    nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Upsample(scale_factor=2.0)),
], ids=["two_3x3", "strided", "reflect", "same_string", "bn_training", "conv_not_first",
        "upsample"])
def test_a_block_whose_halo_is_not_its_first_convolutions_is_not_cropped(block):
    assert not computes_core(block)


def test_a_container_with_its_own_forward_is_not_cropped():
    class Residual(nn.Sequential):
        def forward(self, x):
            return x + super().forward(x)

    assert not computes_core(Residual(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()))
    assert computes_core(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()))
