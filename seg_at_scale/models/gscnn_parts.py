"""The building blocks of Gated-SCNN (:mod:`seg_at_scale.models.gscnn`), written from the paper.

Residual blocks of the regular stream, the shape stream's input projection and gated
convolutional layer (GCL), the fusion of the boundary map with the image gradient, the ASPP
head with its image-level pooling and boundary branch, and the DeepLab-v3+ style decoder.
Shapes are ``[B, C, H, W]``; every convolution is same-padded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["STRIDE", "ResBlock", "ShapeIn", "GatedConv", "EdgeFusion", "ImagePool", "ASPP",
           "Decoder", "conv_block", "upsample"]

STRIDE = 8  # output stride of the regular stream (the paper's)


def conv_block(cin: int, cout: int, k: int, norm: str, *, stride: int = 1, dilation: int = 1,
          relu: bool = True) -> nn.Sequential:
    """``k x k`` same-padded convolution, optional BatchNorm, optional ReLU."""
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride=stride, dilation=dilation,
                                         padding=dilation * (k // 2), bias=norm == "none")]
    if norm == "batch":
        layers.append(nn.BatchNorm2d(cout))
    if relu:
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class ResBlock(nn.Module):
    """Basic residual block: ``relu(proj(x) + conv-norm-relu-conv-norm(x))``."""

    def __init__(self, cin: int, cout: int, norm: str, *, stride: int = 1,
                 dilation: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(conv_block(cin, cout, 3, norm, stride=stride, dilation=dilation),
                                  conv_block(cout, cout, 3, norm, dilation=dilation, relu=False))
        self.proj = (nn.Identity() if cin == cout and stride == 1
                     else conv_block(cin, cout, 1, norm, stride=stride, relu=False))

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.proj(x) + self.body(x))


def upsample(x: Tensor, size: Sequence[int]) -> Tensor:
    """Bilinear resize of ``x`` to ``size`` (``(H, W)``); unchanged when already that size."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x, size=tuple(size), mode="bilinear", align_corners=False)


class ShapeIn(nn.Module):
    """Shape stream input: the stem features (1/2) projected, then upsampled to full size."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(cin, cout, 1)

    def forward(self, x: Tensor) -> Tensor:
        return upsample(self.proj(x), (2 * x.shape[-2], 2 * x.shape[-1]))


class GatedConv(nn.Module):
    """Gated convolutional layer (the paper's eq. 1-2).

    ``r`` (regular-stream features at any resolution) is squeezed to one channel and
    upsampled to ``s``; ``alpha = sigmoid(conv1x1(concat(s, r)))``; the output is
    ``conv1x1(s * alpha + s)`` (residual gating, then a channel-wise weighting).
    """

    def __init__(self, shape_in: int, regular_in: int, cout: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(regular_in, 1, 1)
        self.attention = nn.Conv2d(shape_in + 1, 1, 1)
        self.out = nn.Conv2d(shape_in, cout, 1)

    def forward(self, s: Tensor, r: Tensor) -> Tensor:
        r = upsample(self.squeeze(r), s.shape[-2:])
        alpha = torch.sigmoid(self.attention(torch.cat([s, r], dim=1)))
        return self.out(s * alpha + s)


class EdgeFusion(nn.Module):
    """``sigmoid(conv1x1(concat(sigmoid(boundary logits), canny)))``: one attention channel."""

    def __init__(self, edge_band: int | None) -> None:
        super().__init__()
        self.edge_band = edge_band
        self.conv = nn.Conv2d(1 if edge_band is None else 2, 1, 1)

    def forward(self, edge_logits: Tensor, *inputs: Tensor) -> Tensor:
        maps = [torch.sigmoid(edge_logits)]
        if self.edge_band is not None:
            b = self.edge_band
            maps.append(inputs[0][:, b : b + 1 if b != -1 else None])
        return torch.sigmoid(self.conv(torch.cat(maps, dim=1)))


class ImagePool(nn.Module):
    """The paper's image-level pooling branch: global mean, 1x1 conv, ReLU, broadcast.

    ``fixed`` (``[B, C, 1, 1]``), when set, replaces the mean: the two-pass scheme puts the
    whole image's mean there so that every tile sees it.
    """

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 1)
        self.fixed: Tensor | None = None

    def hold_for_probe(self) -> None:
        """Hold a constant mean (the halo probe's copy: the pooling is tiled in two passes)."""
        self.fixed = torch.zeros(1, self.conv.in_channels, 1, 1, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        m = x.mean(dim=(2, 3), keepdim=True) if self.fixed is None else self.fixed.to(x)
        return F.relu(self.conv(m)).expand(x.shape[0], -1, *x.shape[-2:])  # a batch of tiles


class ASPP(nn.Module):
    """Atrous spatial pyramid pooling with image pooling and the boundary branch.

    ``forward(feat, boundary)``: ``feat [B, C, h, w]`` at 1/8, ``boundary [B, 1, 8h, 8w]``
    (the fused attention, averaged over each 8 x 8 block so tiles stay aligned).
    """

    def __init__(self, cin: int, width: int, rates: Sequence[int], norm: str,
                 image_pool: bool) -> None:
        super().__init__()
        self.branches = nn.ModuleList([conv_block(cin, width, 1, norm)] + [
            conv_block(cin, width, 3, norm, dilation=r) for r in rates])
        self.pool = ImagePool(cin, width) if image_pool else None
        self.edge = conv_block(1, width, 1, "none")
        n = len(self.branches) + 1 + (self.pool is not None)
        self.project = conv_block(n * width, width, 1, norm)

    def forward(self, feat: Tensor, boundary: Tensor) -> Tensor:
        outs = [b(feat) for b in self.branches]
        if self.pool is not None:
            outs.append(self.pool(feat))
        outs.append(self.edge(F.avg_pool2d(boundary, STRIDE)))
        return self.project(torch.cat(outs, dim=1))


class Decoder(nn.Module):
    """``forward(x, low)``: upsample ASPP output to stage 1 (1/4), fuse, classify, upsample."""

    def __init__(self, cin: int, low_in: int, width: int, num_classes: int, norm: str) -> None:
        super().__init__()
        self.low = conv_block(low_in, max(8, width // 4), 1, norm)
        self.fuse = nn.Sequential(conv_block(cin + max(8, width // 4), width, 3, norm),
                                  conv_block(width, width, 3, norm))
        self.classify = nn.Conv2d(width, num_classes, 1)

    def forward(self, x: Tensor, low: Tensor) -> Tensor:
        x = torch.cat([upsample(x, low.shape[-2:]), self.low(low)], dim=1)
        y = self.classify(self.fuse(x))
        return upsample(y, (4 * low.shape[-2], 4 * low.shape[-1]))
