"""Per-module memory layout: the convolutions slow in NHWC on CPU compute in NCHW."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from helpers.smp import preset_model
from segmentation_models_pytorch.decoders.deeplabv3.decoder import ASPPSeparableConv
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from seg_at_scale.tiling.layout import NCHWBlock, NCHWConv2d, prefer_layouts


def test_only_dilated_depthwise_convolutions_change_and_keep_their_state():
    net = nn.Sequential(nn.Conv2d(6, 6, 3, padding=8, dilation=8, groups=6),   # changes
                        nn.Conv2d(6, 6, 3, padding=6, dilation=6, groups=6),   # NHWC is faster
                        nn.Conv2d(6, 6, 3, padding=12, dilation=12),           # not depthwise
                        nn.Conv2d(6, 12, 3, padding=12, dilation=12, groups=3))
    keys = list(net.state_dict())
    assert prefer_layouts(net) == 1
    assert [type(m) for m in net] == [NCHWConv2d, nn.Conv2d, nn.Conv2d, nn.Conv2d]
    assert list(net.state_dict()) == keys


@pytest.mark.parametrize("nhwc", [True, False])
def test_nchw_convolution_equals_the_plain_one_in_both_operands_layouts(nhwc, monkeypatch):
    torch.manual_seed(0)
    plain = nn.Conv2d(16, 16, 3, padding=(12, 9), dilation=(12, 9), groups=16)
    conv = nn.Conv2d(16, 16, 3, padding=(12, 9), dilation=(12, 9), groups=16)
    conv.load_state_dict(plain.state_dict())
    prefer_layouts(conv)
    x = torch.randn(2, 16, 45, 37)
    fmt = torch.channels_last if nhwc else torch.contiguous_format
    conv, xin = conv.to(memory_format=fmt), x.contiguous(memory_format=fmt)
    ref = plain(x)
    seen = []
    inner = nn.Conv2d._conv_forward

    def record(self, x, w, b):
        seen.append((x.stride(), w.stride()))
        return inner(self, x, w, b)

    monkeypatch.setattr(nn.Conv2d, "_conv_forward", record)
    y = conv(xin)
    assert torch.allclose(y, ref, atol=1e-6)
    assert y.is_contiguous(memory_format=fmt)  # handed back in its input's layout
    (xs, ws), = seen
    assert xs == x.stride() and ws == (9, 9, 3, 1)  # both operands with NCHW strides


def test_deeplab_aspp_branches_compute_in_nchw_and_nothing_else():
    net = preset_model("deeplabv3plus_test_resnet", "model.options.decoder_atrous_rates=[12,24,36]")
    names = [n for n, m in net.named_modules() if isinstance(m, NCHWConv2d)]
    assert names == [f"net.decoder.aspp.0.convs.{k}.0.{i}" for k in (1, 2, 3) for i in (0, 1)]
    blocks = [n for n, m in net.named_modules() if isinstance(m, NCHWBlock)]
    assert blocks == [f"net.decoder.aspp.0.convs.{k}" for k in (1, 2, 3)]  # with BN and ReLU
    assert all(isinstance(net.get_submodule(b), ASPPSeparableConv) for b in blocks)
    assert not any(isinstance(m, NCHWConv2d | NCHWBlock)
                   for m in preset_model("unet_test_resnet").modules())


def test_a_block_stops_at_a_layer_whose_layout_matters():
    net = nn.Sequential(nn.Sequential(nn.Conv2d(6, 6, 3, padding=8, dilation=8, groups=6),
                                      nn.Conv2d(6, 4, 1), nn.BatchNorm2d(4), nn.ReLU()),
                        nn.Sequential(nn.Conv2d(6, 6, 3, padding=8, dilation=8, groups=6),
                                      nn.Conv2d(6, 6, 3, padding=1)))  # a 3 x 3: no block
    assert prefer_layouts(net) == 2
    assert isinstance(net[0], NCHWBlock) and not isinstance(net[1], NCHWBlock)
    assert [type(m) for m in net[1]] == [NCHWConv2d, nn.Conv2d]
    assert not isinstance(net, NCHWBlock)  # its first leaf opens net[0] only


def _copies_shaped(like: torch.Tensor) -> tuple[Counter, TorchDispatchMode]:
    """Counts the copying ATen operations whose output has ``like``'s shape."""
    counts: Counter = Counter()

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in ("clone", "copy_", "_to_copy", "contiguous") and \
                    isinstance(out, torch.Tensor) and out.shape == like.shape:
                counts[name] += 1
            return out

    return counts, Copies()


@pytest.mark.parametrize("nhwc", [True, False])
def test_aspp_separable_branches_share_one_nchw_copy_and_keep_the_function(nhwc, monkeypatch):
    net = preset_model("deeplabv3plus_test_resnet", "model.options.decoder_atrous_rates=[12,24,36]")
    aspp = net.net.decoder.aspp[0]
    plain = copy.deepcopy(aspp)
    for m in plain.modules():  # back to smp's own classes: the reference
        if isinstance(m, NCHWConv2d):
            m.__class__ = nn.Conv2d
        elif isinstance(m, NCHWBlock):
            m.__class__ = ASPPSeparableConv
    fmt = torch.channels_last if nhwc else torch.contiguous_format
    aspp = aspp.to(memory_format=fmt)
    x = torch.randn(1, aspp.convs[0][0].in_channels, 37, 29).contiguous(memory_format=fmt)
    seen = []
    inner = nn.Conv2d._conv_forward

    def record(self, x, w, b):
        if isinstance(self, NCHWConv2d):
            seen.append(x.is_contiguous() and w.is_contiguous())
        return inner(self, x, w, b)

    monkeypatch.setattr(nn.Conv2d, "_conv_forward", record)
    counts, mode = _copies_shaped(x)
    with torch.no_grad():
        with mode:
            y = aspp(x)
        ref = plain(x.contiguous())
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert y.is_contiguous(memory_format=fmt)
    assert seen == [True] * 6  # depthwise and pointwise, each with NCHW operands
    # the input's NCHW copy made once for the three branches, no copy of their wide
    # depthwise outputs (before: three copies in and three out)
    assert sum(counts.values()) == (1 if nhwc else 0)
