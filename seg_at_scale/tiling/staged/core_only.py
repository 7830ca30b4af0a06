"""A block's output on a tile's core alone, where the block allows it.

A stage tile reads its halo so that its core is exact; everything it computes outside the
core is thrown away. For most layers that work is needed (the next layer's halo), but in a
block that opens with one convolution followed only by per-pixel layers (1 x 1
convolutions, BatchNorm, activations) the halo is the opening convolution's alone: its
output is needed on the core only. DeepLabV3+'s separable ASPP branch is such a block
(depthwise 3 x 3 at rate 12 / 24 / 36, then pointwise 2048 -> 256, BatchNorm, ReLU): on a
tile of the rate-36 branch whose window is 3.4x its core, the pointwise convolution, which
is nearly all the work, ran 3.4 times over.

:func:`core_of` runs the opening convolution on the core alone, as a "valid" convolution
(no padding) of the input rows and columns the core reads, with the zeros the padding adds
at the window's edges, then the per-pixel layers. This equals the block on the whole
window cropped to the core: the same taps read the same values, and at the window's edge
(where the stage's window stops at the map's edge) the same zeros.

A chain of ConvNeXt blocks (each: depthwise 7 x 7, then per-pixel LayerNorm and MLP, plus
the residual) takes the same idea block by block (:func:`shrinking`, :class:`Shrinking`):
each block computes what the blocks after it read, a window shrinking from the tile's to
its core, instead of every block's MLP on the whole halo.

Layout: :func:`core_of` computes in its input's layout, also in a block that
:func:`~seg_at_scale.tiling.layout.prefer_layouts` made compute in NCHW. What is slow
channels-last on CPU is oneDNN's *padded* dilated depthwise convolution (3.25 s for a rate-36
tile of DeepLabV3+-ResNet50's 2048-channel map, torch 2.14.1, 2-core EPYC); the same
convolution without padding takes 0.05 s channels-last, against 0.18 s in NCHW plus 0.34 s
to change the window's layout.

>>> import torch
>>> conv = nn.Conv2d(3, 5, 3, padding=4, dilation=4)
>>> block = nn.Sequential(conv, nn.BatchNorm2d(5).eval(), nn.ReLU(), nn.Conv2d(5, 2, 1))
>>> x = torch.randn(1, 3, 40, 33)
>>> rows, cols = slice(4, 31), slice(0, 25)
>>> with torch.no_grad():
...     torch.allclose(core_of(block, x, rows, cols), block(x)[..., rows, cols], atol=1e-6)
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch.nn.functional as F
from torch import Tensor, nn

from seg_at_scale.tiling.layout import PER_CHANNEL, NCHWBlock, NCHWConv2d, leaves

if TYPE_CHECKING:
    from timm.models.convnext import ConvNeXtBlock

__all__ = ["Shrinking", "computes_core", "core_of", "shrinking", "shrinks"]


def _plain(m: nn.Module) -> bool:
    """Every container in ``m`` runs its children in order (``nn.Sequential``'s forward).

    An :class:`NCHWBlock` mixed in only changes the layout around its class's forward.
    """
    def own_forward(c: nn.Module) -> object:
        return next(k.__dict__["forward"] for k in type(c).__mro__
                    if "forward" in k.__dict__ and k is not NCHWBlock)

    return all(not list(c.children()) or own_forward(c) is nn.Sequential.forward
               for c in m.modules())


def _per_pixel(m: nn.Module) -> bool:
    if isinstance(m, nn.Conv2d):
        return (m.kernel_size == (1, 1) and m.stride == (1, 1) and m.padding == (0, 0)
                and m.dilation == (1, 1))
    return isinstance(m, PER_CHANNEL) and not (isinstance(m, nn.BatchNorm2d) and m.training)


def computes_core(block: nn.Module) -> bool:
    """Whether :func:`core_of` applies: one stride-1 convolution, then per-pixel layers."""
    parts = leaves(block)
    if not parts or not _plain(block) or not isinstance(parts[0], nn.Conv2d):
        return False
    first = parts[0]
    return (first.stride == (1, 1) and first.padding_mode == "zeros"
            and isinstance(first.padding, tuple) and all(map(_per_pixel, parts[1:])))


def core_of(block: nn.Module, x: Tensor, rows: slice, cols: slice) -> Tensor:
    """``block(x)[..., rows, cols]``, computing only those outputs (:func:`computes_core`).

    It computes in ``x``'s layout, in an :class:`~seg_at_scale.tiling.layout.NCHWBlock`
    too: without padding, the dilated depthwise convolution is fast channels-last.
    """
    parts = leaves(block)
    first = cast(nn.Conv2d, parts[0])  # computes_core(block): a Conv2d
    window = []
    for axis, sl in ((-2, rows), (-1, cols)):
        pad, reach = first.padding[axis], first.dilation[axis] * (first.kernel_size[axis] - 1)
        lo, hi = sl.start - pad, sl.stop - pad + reach  # rows of x the core reads
        window.append((lo, hi, x.shape[axis]))
    (r0, r1, h), (c0, c1, w) = window
    part = x[..., max(r0, 0) : min(r1, h), max(c0, 0) : min(c1, w)]
    part = F.pad(part, (max(-c0, 0), max(c1 - w, 0), max(-r0, 0), max(r1 - h, 0)))
    y = F.conv2d(part, first.weight, first.bias, 1, 0, first.dilation, first.groups)
    for m in parts[1:]:  # in the input's layout, NCHW blocks too (see the module notes)
        y = nn.Conv2d.forward(m, y) if isinstance(m, NCHWConv2d) else m(y)
    return y


def _convnext_block(m: nn.Module) -> bool:
    """A timm ConvNeXt block whose halo is its depthwise convolution alone (eval)."""
    from timm.models.convnext import ConvNeXtBlock

    if type(m) is not ConvNeXtBlock or m.training:
        return False
    conv = m.conv_dw
    reach = tuple(d * (k - 1) // 2 for d, k in zip(conv.dilation, conv.kernel_size,
                                                      strict=True))
    return (conv.stride == (1, 1) and conv.padding_mode == "zeros" and conv.padding == reach
            and all(k % 2 for k in conv.kernel_size) and isinstance(m.shortcut, nn.Identity))


def _blocks(chain: nn.Module) -> tuple[list[nn.Module], list[ConvNeXtBlock]]:
    """A chain's modules in order, split into what runs whole and its trailing blocks."""
    from timm.models.convnext import ConvNeXtStage

    flat: list[nn.Module] = []
    for m in getattr(chain, "parts", [chain]):
        if type(m) is ConvNeXtStage and not m.grad_checkpointing:
            flat += [m.downsample, *m.blocks]
        else:
            flat.append(m)
    k = len(flat)
    while k > 0 and _convnext_block(flat[k - 1]):
        k -= 1
    return flat[:k], cast("list[ConvNeXtBlock]", flat[k:])  # _convnext_block: each of them


def _tail(b: ConvNeXtBlock, y: Tensor) -> Tensor:
    """A ConvNeXt block after its depthwise convolution, less the residual (timm's order)."""
    if b.use_conv_mlp:
        y = b.mlp(b.norm(y))
    else:
        y = b.mlp(b.norm(y.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
    if b.gamma is not None:
        y = y.mul(b.gamma.reshape(1, -1, 1, 1))
    return b.drop_path(y)


def shrinks(chain: nn.Module) -> bool:
    """Whether :func:`shrinking` applies: the chain ends in ConvNeXt blocks."""
    return bool(_blocks(chain)[1])


def shrinking(chain: nn.Module, x: Tensor, rows: slice, cols: slice,
              edges: tuple[bool, bool, bool, bool]) -> Tensor:
    """``chain(x)[..., rows, cols]``, each trailing ConvNeXt block computing what is read.

    Each block computes only what the blocks after it read (:func:`shrinks`). A tile's
    halo is there for the depthwise convolutions of its blocks: the first block's
    output is needed up to the halo less its own reach, the next one's up to less two
    reaches, and so on to the core; computed on the whole window, every block's MLP (nearly
    all of a ConvNeXt's work) ran on the full halo. Here each block's depthwise convolution
    is unpadded on the window's sides inside the map (the window shrinks by its reach there)
    and zero-padded on the sides at the map's edge (``edges``: top, bottom, left, right),
    as the whole map's convolution is; the residual is cropped alike.
    """
    whole, blocks = _blocks(chain)
    for m in whole:
        x = m(x)
    cut = [0, 0]  # rows and columns taken off the window's top and left
    for b in blocks:
        (ph, pw), h, w = b.conv_dw.padding, x.shape[-2], x.shape[-1]
        top, bottom, left, right = (0 if e else p for e, p in zip(edges, (ph, ph, pw, pw),
                                                                    strict=True))
        pad = (pw - left, pw - right, ph - top, ph - bottom)
        y = F.conv2d(F.pad(x, pad) if any(pad) else x, b.conv_dw.weight, b.conv_dw.bias,
                     1, 0, b.conv_dw.dilation, b.conv_dw.groups)
        shortcut = x[..., top : h - bottom, left : w - right]
        x = _tail(b, y) + shortcut
        cut = [cut[0] + top, cut[1] + left]
    r0, r1, c0, c1 = rows.start - cut[0], rows.stop - cut[0], cols.start - cut[1], \
        cols.stop - cut[1]
    if min(r0, c0) < 0 or r1 > x.shape[-2] or c1 > x.shape[-1]:
        raise ValueError(f"shrinking: the window's halo around rows {rows.start}:{rows.stop}"
                         f", columns {cols.start}:{cols.stop} is narrower than the blocks' "
                         f"reach (left {x.shape[-2]} x {x.shape[-1]} of the window)")
    return x[..., r0:r1, c0:c1]


class Shrinking(nn.Module):
    """A stage's chain (``Chain``) that computes its tiles' cores by :func:`shrinking`."""

    computes_core = True

    def __init__(self, chain: nn.Module) -> None:
        super().__init__()
        self.chain = chain

    def forward(self, xs: list[Tensor], core: tuple[slice, slice] | None = None,
                edges: tuple[bool, bool, bool, bool] | None = None) -> Tensor:
        if core is None or edges is None:
            return self.chain(xs)
        (x,) = xs
        return shrinking(self.chain, x, *core, edges)
