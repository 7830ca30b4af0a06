"""Memory layout per module: channels-last where it is faster, contiguous where it is not.

Prediction and training run tiles in the channels-last (NHWC) layout (``layout=auto``),
which makes the fp32 forward of every family 1.1-2.6x faster on CPU. One kind of
convolution is the exception: a **depthwise convolution with a large dilation**, as in
DeepLabV3+'s separable ASPP branches (rates 12 / 24 / 36). oneDNN runs it 3.2-4.1x slower
in NHWC than in NCHW on CPU at dilation >= 8, while at dilation <= 6 NHWC is 2.4-3x faster
(torch 2.14.1, 2-core AMD EPYC; 64-2048 channels, 64-512 px). That one layer made the
whole DeepLabV3+-ResNet50 0.87x slower channels-last.

:func:`prefer_layouts` gives each such convolution its own layout: on CPU it computes in
NCHW and hands its output back in its input's layout, so the network around it stays
channels-last. The weights, the state dict and the function are unchanged; the tiled and
the untiled forward run the same code, so tiling stays exact.

>>> import torch
>>> from torch import nn
>>> net = nn.Sequential(nn.Conv2d(8, 8, 3, padding=12, dilation=12, groups=8))
>>> prefer_layouts(net)
1
>>> x = torch.randn(1, 8, 40, 40).contiguous(memory_format=torch.channels_last)
>>> net(x).is_contiguous(memory_format=torch.channels_last)
True
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["NCHWConv2d", "prefer_layouts", "SLOW_NHWC_DILATION"]

#: Depthwise convolutions with at least this dilation compute in NCHW on CPU.
SLOW_NHWC_DILATION = 8


class NCHWConv2d(nn.Conv2d):
    """A convolution that computes in NCHW on CPU whatever its input's layout."""

    def forward(self, x: Tensor) -> Tensor:
        nhwc = x.device.type == "cpu" and not x.is_contiguous() and x.is_contiguous(
            memory_format=torch.channels_last)
        if not nhwc:
            return super().forward(x)
        # both operands with NCHW strides: oneDNN picks NHWC when either one has NHWC
        # strides, and a [C, 1, k, k] weight counts as contiguous in both layouts
        w = self.weight.clone(memory_format=torch.contiguous_format)
        y = self._conv_forward(x.contiguous(), w, self.bias)
        return y.contiguous(memory_format=torch.channels_last)


def _slow_in_nhwc(m: nn.Module) -> bool:
    return (type(m) is nn.Conv2d and m.groups > 1 and m.groups == m.in_channels
            and max(m.dilation) >= SLOW_NHWC_DILATION)


def prefer_layouts(net: nn.Module) -> int:
    """Make every convolution that is slow channels-last compute in NCHW (in place).

    Returns:
        How many convolutions were changed.
    """
    slow = [m for m in net.modules() if _slow_in_nhwc(m)]
    for m in slow:
        m.__class__ = NCHWConv2d
    return len(slow)
