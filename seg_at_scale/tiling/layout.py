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
channels-last. Where the convolution opens a block of convolutions, BatchNorms and
activations (DeepLabV3+'s separable branch: depthwise, pointwise 2048 -> 256, BatchNorm,
ReLU), the whole block computes in NCHW (:class:`NCHWBlock`): its input changes layout on
the way in and its 8x smaller output on the way out, instead of the 2048-channel map
both ways around the depthwise convolution alone (the three branches 1.5-1.6x faster).
Branches reading one input share its NCHW copy (:class:`SharedNCHW`). The weights, the
state dict and the function are unchanged; the tiled and the untiled forward run the
same code, so tiling stays exact.

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

__all__ = ["NCHWConv2d", "NCHWBlock", "PER_CHANNEL", "SharedNCHW", "leaves", "prefer_layouts",
           "SLOW_NHWC_DILATION"]

#: Depthwise convolutions with at least this dilation compute in NCHW on CPU.
SLOW_NHWC_DILATION = 8
#: Per-channel layers a block computing in NCHW may hold after its opening convolution.
PER_CHANNEL = (nn.BatchNorm2d, nn.ReLU, nn.ReLU6, nn.SiLU, nn.GELU, nn.Identity)


def _cpu_nhwc(x: Tensor) -> bool:
    return x.device.type == "cpu" and not x.is_contiguous() and x.is_contiguous(
        memory_format=torch.channels_last)


class NCHWConv2d(nn.Conv2d):
    """A convolution that computes in NCHW on CPU whatever its input's layout."""

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu":
            return super().forward(x)
        # both operands with NCHW strides: oneDNN picks NHWC when either one has NHWC
        # strides, and a [C, 1, k, k] or [O, I, 1, 1] weight counts as contiguous in both
        w = self.weight.clone(memory_format=torch.contiguous_format)
        y = self._conv_forward(x.contiguous(), w, self.bias)
        return y.contiguous(memory_format=torch.channels_last) if _cpu_nhwc(x) else y


class NCHWBlock(nn.Module):
    """Mixed into a block's class: the block computes in NCHW on CPU.

    It hands its output back in its input's layout; its convolutions are NCHWConv2d.
    """

    def forward(self, x: Tensor) -> Tensor:
        if not _cpu_nhwc(x):
            return super().forward(x)
        y = super().forward(x.contiguous())
        return y.contiguous(memory_format=torch.channels_last)


class SharedNCHW:
    """An input several branches read: the NCHW blocks among them share one NCHW copy.

    >>> from torch import nn
    >>> a = nn.Sequential(nn.Conv2d(4, 4, 3, padding=8, dilation=8, groups=4), nn.ReLU())
    >>> b = nn.Sequential(nn.Conv2d(4, 4, 3, padding=9, dilation=9, groups=4), nn.ReLU())
    >>> prefer_layouts(a), prefer_layouts(b)
    (1, 1)
    >>> src = SharedNCHW(torch.randn(1, 4, 20, 20).contiguous(memory_format=torch.channels_last))
    >>> [src.run(m).is_contiguous(memory_format=torch.channels_last) for m in (a, b)]
    [True, True]
    >>> src.copies
    1
    """

    def __init__(self, x: Tensor) -> None:
        self.x, self.copies = x, 0
        self._nchw: Tensor | None = None

    def run(self, m: nn.Module) -> Tensor:
        """``m(x)``, in ``x``'s layout."""
        if not (isinstance(m, NCHWBlock) and _cpu_nhwc(self.x)):
            return m(self.x)
        if self._nchw is None:
            self._nchw, self.copies = self.x.contiguous(), self.copies + 1
        return m(self._nchw).contiguous(memory_format=torch.channels_last)


def _slow_in_nhwc(m: nn.Module) -> bool:
    return (type(m) is nn.Conv2d and m.groups > 1 and m.groups == m.in_channels
            and max(m.dilation) >= SLOW_NHWC_DILATION)


def leaves(m: nn.Module) -> list[nn.Module]:
    """``m``'s modules without children, in order."""
    return [c for c in m.modules() if not list(c.children())]


def _block_part(m: nn.Module) -> bool:
    """What may follow a block's opening convolution: 1 x 1 convolutions, per-channel layers.

    The layout matters little to a 1 x 1 convolution, and it shrinks the map to hand back.
    """
    pointwise = type(m) is nn.Conv2d and m.kernel_size == (1, 1) and m.groups == 1
    return pointwise or isinstance(m, PER_CHANNEL)


def _block_of(net: nn.Module, conv: nn.Module) -> nn.Module:
    """The largest sequence that ``conv`` opens, then only :func:`_block_part` layers.

    ``conv`` itself when there is none.
    """
    best = conv
    for m in net.modules():
        if (isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward
                and leaves(m) and leaves(m)[0] is conv
                and all(_block_part(c) for c in leaves(m)[1:])
                and len(leaves(m)) > len(leaves(best))):
            best = m
    return best


_BLOCKS: dict[type, type] = {}


def _as_block(m: nn.Module) -> None:
    """Mix :class:`NCHWBlock` into ``m``'s class (isinstance of its own class kept)."""
    cls = type(m)
    if not isinstance(m, NCHWBlock):
        if cls not in _BLOCKS:
            name = f"NCHW{cls.__name__}"
            _BLOCKS[cls] = type(name, (NCHWBlock, cls), {"__module__": __name__,
                                                         "__qualname__": name})
        m.__class__ = _BLOCKS[cls]


def prefer_layouts(net: nn.Module) -> int:
    """Make every convolution slow channels-last compute in NCHW, with its block (in place).

    Returns:
        How many such convolutions were found.
    """
    slow = [m for m in net.modules() if _slow_in_nhwc(m)]
    for conv in slow:
        block = _block_of(net, conv)
        for c in leaves(block):
            if type(c) is nn.Conv2d:
                c.__class__ = NCHWConv2d
        if block is not conv:
            _as_block(block)
    return len(slow)
