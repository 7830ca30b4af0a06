"""Per-module memory layout: the convolutions slow in NHWC on CPU compute in NCHW."""

from __future__ import annotations

import pytest
import torch
from smp_helpers import preset_model
from torch import nn

from seg_at_scale.models.layout import NCHWConv2d, prefer_layouts


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
    assert names == [f"net.decoder.aspp.0.convs.{k}.0.0" for k in (1, 2, 3)]
    assert not any(isinstance(m, NCHWConv2d) for m in preset_model("unet_test_resnet").modules())
