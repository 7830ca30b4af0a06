"""A block computing only a tile's core (``tiling.staged.core_only``) == the block cropped to it."""

from __future__ import annotations

import pytest
import torch
from helpers.smp import lively_norms
from segmentation_models_pytorch.decoders.deeplabv3.decoder import ASPPConv, ASPPSeparableConv
from torch import nn

from seg_at_scale.tiling.layout import NCHWBlock, prefer_layouts
from seg_at_scale.tiling.staged.core_only import computes_core, core_of

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
    block = lively_norms(block, seed=1)
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


def _convnext_stage(conv_mlp: bool = False, **kw) -> nn.Module:
    from timm.layers import LayerNorm, LayerNorm2d
    from timm.models.convnext import ConvNeXtStage

    from seg_at_scale.tiling.staged import Chain

    torch.manual_seed(0)
    stage = ConvNeXtStage(6, 8, kernel_size=5, stride=2, depth=3, conv_mlp=conv_mlp,
                          ls_init_value=0.5, norm_layer=LayerNorm2d,
                          norm_layer_cl=LayerNorm2d if conv_mlp else LayerNorm, **kw).eval()
    for p in stage.parameters():  # lively: biases and scales far from their init
        p.data.add_(torch.randn_like(p) * 0.1)
    return Chain(stage)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("kind", ["linear_mlp", "conv_mlp", "dilated"])
def test_convnext_blocks_shrinking_to_the_core_equal_the_stage_cropped(kind, layout):
    """Three ConvNeXt blocks after a stride-2 downsample; windows of odd sizes with the
    map's edge on no side, one side, or all (zero padding there, shrinking elsewhere);
    the stage's output cropped to the core."""
    from seg_at_scale.tiling.staged.core_only import shrinking, shrinks

    chain = _convnext_stage(conv_mlp=kind == "conv_mlp",
                            **({"dilation": (1, 2)} if kind == "dilated" else {}))
    reach = 2 * (2 if kind == "dilated" else 1) * 3  # per side: 3 blocks x dilation x 2
    assert shrinks(chain)
    x = torch.randn(1, 6, 2 * 41, 2 * 37)
    if layout == "channels_last":
        chain, x = chain.to(memory_format=torch.channels_last), x.contiguous(
            memory_format=torch.channels_last)
    cases = [  # (rows, cols, edges: top, bottom, left, right)
        (slice(reach, 41 - reach), slice(reach, 37 - reach), (False,) * 4),
        (slice(0, 41 - reach), slice(reach + 3, 37), (True, False, False, True)),
        (slice(reach, 41), slice(0, 37 - reach), (False, True, True, False)),
        (slice(0, 41), slice(0, 37), (True,) * 4),
        (slice(0, 20), slice(reach, 19), (True, False, False, False)),
    ]
    with torch.no_grad():
        whole = chain([x])
        for rows, cols, edges in cases:
            y = shrinking(chain, x, rows, cols, edges)
            torch.testing.assert_close(y, whole[..., rows, cols], atol=1e-5, rtol=1e-5)
        for rows, cols in ((slice(reach - 1, 30), slice(0, 37)),
                           (slice(0, 41), slice(0, 37 - reach + 1))):
            with pytest.raises(ValueError, match="narrower than the blocks' reach"):
                shrinking(chain, x, rows, cols, (True, False, True, False))


def test_what_does_not_shrink():
    """Blocks in training mode (drop path, BatchNorm-free but live), a stage checkpointed
    by timm, and chains of other modules run on the whole window."""
    from seg_at_scale.tiling.staged import Chain
    from seg_at_scale.tiling.staged.core_only import shrinks

    assert not shrinks(_convnext_stage().train())
    checkpointed = _convnext_stage()
    checkpointed.parts[0].grad_checkpointing = True
    assert not shrinks(checkpointed)
    assert not shrinks(Chain(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()))
