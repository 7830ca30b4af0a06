"""UResNet for neutrino-detector wire planes (after Acciarri et al. 2021, SBND).

A U-Net whose levels are residual blocks, applied to the three wire planes of an event
with *shared weights*: the planes are folded into the batch for the encoder and decoder
and meet only in the deepest block, where their bottleneck features are concatenated
along channels, mixed, and split back. Written from the paper's description.

Tensor layout (chosen so the 4-D tiling code works unchanged):

* input ``[B, P, H, W]``: plane ``p`` is input channel ``p`` (one channel per plane);
* logits ``[B, P * K, H, W]``: plane ``p``'s class ``k`` is channel ``p * K + k``;
  :func:`plane_view` reshapes them to ``[B, K, P, H, W]``.

Padding is ``same`` everywhere; ``H`` and ``W`` must be multiples of the downsampling
factor ``2^(depth - 1)`` (the tiling code pads the image to one). With
``batch_norm=False`` (or in eval mode) the network has no whole-image statistics, so halo
tiling is exact (``docs/design.md``).

>>> net = UResNet(**URESNET_SIZES["tiny"].kwargs()).eval()
>>> net(torch.zeros(2, 3, 64, 96)).shape, net.footprint().align
(torch.Size([2, 9, 64, 96]), 4)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.models.layers import Merge, Skip
from seg_at_scale.tiling.geometry import Footprint

__all__ = ["UResNet", "UResNetSize", "URESNET_SIZES", "plane_view", "ResidualBlock"]

GROWTH = ("additive", "multiplicative")
CONNECTIONS = ("concat", "sum", "none")
DOWNSAMPLE = ("max_pool", "strided_conv")
UPSAMPLE = ("interpolation", "transpose")


@dataclass(frozen=True)
class UResNetSize:
    """Depth and width of a UResNet preset."""

    depth: int
    initial_filters: int
    blocks_per_layer: int
    blocks_deepest: int
    bottleneck_deepest: int

    def kwargs(self) -> dict[str, int]:
        return asdict(self)


URESNET_SIZES: dict[str, UResNetSize] = {
    "tiny": UResNetSize(depth=3, initial_filters=4, blocks_per_layer=1, blocks_deepest=1,
                        bottleneck_deepest=8),
    "small": UResNetSize(depth=4, initial_filters=8, blocks_per_layer=1, blocks_deepest=2,
                         bottleneck_deepest=32),
    "medium": UResNetSize(depth=5, initial_filters=16, blocks_per_layer=2, blocks_deepest=3,
                          bottleneck_deepest=128),
    # CosmicTagger-like: depth 6, 16 initial filters, 2 blocks per layer
    "cosmic": UResNetSize(depth=6, initial_filters=16, blocks_per_layer=2, blocks_deepest=5,
                          bottleneck_deepest=256),
}


def plane_view(logits: Tensor, planes: int) -> Tensor:
    """``[B, P * K, H, W]`` logits as ``[B, K, P, H, W]`` (a view when contiguous)."""
    b, pk, h, w = logits.shape
    if pk % planes:
        raise ValueError(f"{pk} logit channels are not a multiple of {planes} planes")
    return logits.reshape(b, planes, pk // planes, h, w).transpose(1, 2)


def _norm(batch_norm: bool, channels: int) -> nn.Module:
    return nn.BatchNorm2d(channels) if batch_norm else nn.Identity()


def conv_norm_relu(cin: int, cout: int, kernel: int, batch_norm: bool,
                   stride: int = 1) -> nn.Sequential:
    """Convolution (``same`` padding unless strided), optional batch norm, ReLU."""
    pad = kernel // 2 if stride == 1 else 0
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride=stride, padding=pad,
                                   bias=not batch_norm),
                         _norm(batch_norm, cout), nn.ReLU(inplace=True))


class ResidualBlock(nn.Module):
    """``relu(x + bn(conv(relu(bn(conv(x))))))`` with ``kernel x kernel`` convolutions."""

    def __init__(self, channels: int, kernel: int = 3, batch_norm: bool = True) -> None:
        super().__init__()
        self.kernel = kernel
        self.conv1 = nn.Conv2d(channels, channels, kernel, padding=kernel // 2,
                               bias=not batch_norm)
        self.norm1 = _norm(batch_norm, channels)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, kernel, padding=kernel // 2,
                               bias=not batch_norm)
        self.norm2 = _norm(batch_norm, channels)
        self.relu2 = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        y = self.relu1(self.norm1(self.conv1(x)))
        return self.relu2(x + self.norm2(self.conv2(y)))


class FoldPlanes(nn.Module):
    """``[B, P, H, W] -> [B * P, 1, H, W]``: planes share the network's weights."""

    def forward(self, x: Tensor) -> Tensor:
        return x.reshape(-1, 1, x.shape[-2], x.shape[-1])


class JoinPlanes(nn.Module):
    """``[B * P, C, h, w] -> [B, P * C, h, w]`` (plane ``p``'s channels at ``p * C ...``)."""

    def __init__(self, planes: int) -> None:
        super().__init__()
        self.planes = planes

    def forward(self, x: Tensor) -> Tensor:
        n, c, h, w = x.shape
        return x.reshape(n // self.planes, self.planes * c, h, w)

    def extra_repr(self) -> str:
        return f"planes={self.planes}"


class SplitPlanes(JoinPlanes):
    """``[B, P * C, h, w] -> [B * P, C, h, w]``, the inverse of :class:`JoinPlanes`."""

    def forward(self, x: Tensor) -> Tensor:
        b, pc, h, w = x.shape
        return x.reshape(b * self.planes, pc // self.planes, h, w)


class UResNet(nn.Module):
    """Residual U-Net over detector planes with shared weights and a joint deepest block.

    Args:
        planes: wire planes P (input channels, one per plane).
        num_classes: classes K per plane (background, cosmic, neutrino).
        depth: resolution levels (``depth - 1`` downsamplings; factor ``2^(depth-1)``).
        initial_filters: channels at the first level.
        blocks_per_layer: residual blocks per level, in the encoder and in the decoder.
        blocks_deepest: residual blocks in the deepest (plane-joining) block.
        bottleneck_deepest: channels of the deepest block (after a 1 x 1 mixing conv).
        growth: ``"additive"`` (level ``k`` has ``initial_filters * (k + 1)`` channels) or
            ``"multiplicative"`` (``initial_filters * 2^k``).
        connections: encoder-to-decoder skips: ``"concat"`` (then a 1 x 1 conv),
            ``"sum"`` or ``"none"``.
        downsample: ``"max_pool"`` (2 x 2, then 1 x 1 conv) or ``"strided_conv"`` (2 x 2,
            stride 2).
        upsample: ``"interpolation"`` (bilinear x 2, then 1 x 1 conv) or ``"transpose"``
            (2 x 2 transposed conv, stride 2).
        batch_norm: batch norm after every convolution (not tile-exact in train mode).
        initial_kernel: kernel of the first convolution.
        deepest_kernel: kernel of the deepest block's residual convolutions.
        padding: ``"same"`` only (accepted so configs shared with the U-Net compose).

    Shapes:
        ``[B, P, H, W] -> [B, P * K, H, W]`` (see module docstring).
    """

    def __init__(self, planes: int = 3, num_classes: int = 3, depth: int = 6,
                 initial_filters: int = 16, blocks_per_layer: int = 2, blocks_deepest: int = 5,
                 bottleneck_deepest: int = 256, growth: str = "additive",
                 connections: str = "concat", downsample: str = "max_pool",
                 upsample: str = "interpolation", batch_norm: bool = True,
                 initial_kernel: int = 5, deepest_kernel: int = 3,
                 padding: str = "same") -> None:
        super().__init__()
        _check_args(locals())
        self.in_channels = self.planes = planes  # in_channels: for the halo probe
        self.num_classes, self.depth = num_classes, depth
        self.blocks_per_layer, self.blocks_deepest = blocks_per_layer, blocks_deepest
        self.growth, self.connections = growth, connections
        self.downsample, self.upsample, self.batch_norm = downsample, upsample, batch_norm
        self.initial_kernel, self.deepest_kernel = initial_kernel, deepest_kernel
        bn = batch_norm
        f = [initial_filters * ((k + 1) if growth == "additive" else 2**k) for k in range(depth)]
        self.widths = f
        self.fold = FoldPlanes()
        self.stem = conv_norm_relu(1, f[0], initial_kernel, bn)
        self.enc = nn.ModuleList(
            nn.Sequential(*(ResidualBlock(f[k], 3, bn) for _ in range(blocks_per_layer)))
            for k in range(depth - 1))
        self.downs = nn.ModuleList(self._down(f[k], f[k + 1]) for k in range(depth - 1))
        pc = planes * f[-1]
        self.deepest = nn.Sequential(
            JoinPlanes(planes), conv_norm_relu(pc, bottleneck_deepest, 1, bn),
            *(ResidualBlock(bottleneck_deepest, deepest_kernel, bn)
              for _ in range(blocks_deepest)),
            conv_norm_relu(bottleneck_deepest, pc, 1, bn), SplitPlanes(planes))
        levels = list(reversed(range(depth - 1)))  # decoder order: deepest first
        self.ups = nn.ModuleList(self._up(f[k + 1], f[k]) for k in levels)
        self.merges = nn.ModuleList(
            conv_norm_relu(2 * f[k], f[k], 1, bn) if connections == "concat" else nn.Identity()
            for k in levels)
        self.dec = nn.ModuleList(
            nn.Sequential(*(ResidualBlock(f[k], 3, bn) for _ in range(blocks_per_layer)))
            for k in levels)
        self.head = nn.Conv2d(f[0], num_classes, 1)
        self.unfold = JoinPlanes(planes)

    def _down(self, cin: int, cout: int) -> nn.Sequential:
        if self.downsample == "max_pool":
            return nn.Sequential(nn.MaxPool2d(2), *conv_norm_relu(cin, cout, 1, self.batch_norm))
        return conv_norm_relu(cin, cout, 2, self.batch_norm, stride=2)

    def _up(self, cin: int, cout: int) -> nn.Sequential:
        if self.upsample == "transpose":
            up = nn.ConvTranspose2d(cin, cout, 2, stride=2, bias=not self.batch_norm)
            return nn.Sequential(up, _norm(self.batch_norm, cout), nn.ReLU(inplace=True))
        return nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
                             *conv_norm_relu(cin, cout, 1, self.batch_norm))

    @property
    def downsampling_factor(self) -> int:
        return 2 ** (self.depth - 1)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[B, P * K, H, W]`` for planes ``[B, P, H, W]``."""
        self._check_input(x)
        x = self.stem(self.fold(x))
        skips = []
        for block, down in zip(self.enc, self.downs):
            x = block(x)
            skips.append(x)
            x = down(x)
        x = self.deepest(x)
        for up, merge, block, skip in zip(self.ups, self.merges, self.dec, reversed(skips)):
            x = up(x)
            if self.connections == "concat":
                x = merge(torch.cat([skip, x], dim=1))
            elif self.connections == "sum":
                x = x + skip
            x = block(x)
        return self.unfold(self.head(x))

    def pipeline_layers(self) -> list[nn.Module]:
        """The network as a flat layer list (one entry per residual block, conv, pool, ...).

        Encoder level ``k`` stashes its output as ``skip{k}`` (unless ``connections`` is
        ``"none"``); the decoder pops it into a :class:`Merge`. The layers are this model's
        own modules, so ``run_layers(net.pipeline_layers(), x)`` equals ``net(x)``.
        """
        def flat(seq: nn.Module) -> list[nn.Module]:  # each part passed is a Sequential
            return [m for m in cast(nn.Sequential, seq) if not isinstance(m, nn.Identity)]

        layers: list[nn.Module] = [self.fold, *flat(self.stem)]
        for k, (block, down) in enumerate(zip(self.enc, self.downs)):
            body = list(cast(nn.Sequential, block))
            if self.connections != "none":
                body[-1] = Skip(body[-1], stash=(f"skip{k}",))
            layers += body + flat(down)
        layers += flat(self.deepest)
        for j, (up, merge, block) in enumerate(zip(self.ups, self.merges, self.dec)):
            k = self.depth - 2 - j
            layers += flat(up)
            if self.connections != "none":
                layers.append(Skip(Merge(self.connections), pop=(f"skip{k}",)))
            layers += flat(merge) if self.connections == "concat" else []
            layers += list(cast(nn.Sequential, block))
        return layers + [self.head, self.unfold]

    def footprint(self) -> Footprint:
        """Halo and alignment, by interval arithmetic over the architecture (``same``)."""
        return Footprint(uresnet_halo(self), self.downsampling_factor, "same", 0)

    def _check_input(self, x: Tensor) -> None:
        d = self.downsampling_factor
        if x.dim() != 4 or x.shape[1] != self.planes:
            raise ValueError(f"UResNet expects planes [B, {self.planes}, H, W], got "
                             f"{tuple(x.shape)}")
        if x.shape[-2] % d or x.shape[-1] % d:
            raise ValueError(f"UResNet input {x.shape[-2]}x{x.shape[-1]} is not a multiple of "
                             f"its downsampling factor {d}; pad it (the tiling code does)")


# ----- geometry (analytic): receptive-field spans walked backwards ----------------------


def uresnet_halo(net: UResNet) -> int:
    """Aligned halo: how far the receptive fields of one aligned output block reach past it."""
    d = net.downsampling_factor
    base = 64 * d * net.depth  # aligned and far from any border
    lo, hi = _decoder_span(net, 0, base, base + d - 1)
    return max(base - lo, hi - (base + d - 1))


def _res(lo: int, hi: int, blocks: int, kernel: int = 3) -> tuple[int, int]:
    r = 2 * blocks * (kernel // 2)  # two convolutions per residual block
    return lo - r, hi + r


def _encoder_span(net: UResNet, level: int, lo: int, hi: int) -> tuple[int, int]:
    lo, hi = _res(lo, hi, net.blocks_per_layer)
    if level == 0:
        r = net.initial_kernel // 2
        return lo - r, hi + r
    return _encoder_span(net, level - 1, 2 * lo, 2 * hi + 1)  # 2 x 2 pool / strided conv


def _deepest_span(net: UResNet, lo: int, hi: int) -> tuple[int, int]:
    lo, hi = _res(lo, hi, net.blocks_deepest, net.deepest_kernel)
    return _encoder_span(net, net.depth - 2, 2 * lo, 2 * hi + 1)


def _up_back(net: UResNet, lo: int, hi: int) -> tuple[int, int]:
    if net.upsample == "interpolation":  # bilinear, align_corners=False: floor(i/2 - 1/4), +1
        return (2 * lo - 1) // 4, (2 * hi - 1) // 4 + 1
    return lo // 2, hi // 2


def _decoder_span(net: UResNet, level: int, lo: int, hi: int) -> tuple[int, int]:
    lo, hi = _res(lo, hi, net.blocks_per_layer)
    u_lo, u_hi = _up_back(net, lo, hi)
    if level + 1 == net.depth - 1:
        u_lo, u_hi = _deepest_span(net, u_lo, u_hi)
    else:
        u_lo, u_hi = _decoder_span(net, level + 1, u_lo, u_hi)
    if net.connections == "none":
        return u_lo, u_hi
    s_lo, s_hi = _encoder_span(net, level, lo, hi)
    return min(s_lo, u_lo), max(s_hi, u_hi)


def _check_args(a: dict[str, Any]) -> None:
    for key in ("planes", "num_classes", "initial_filters", "bottleneck_deepest",
                "blocks_per_layer", "initial_kernel", "deepest_kernel"):
        if int(a[key]) < 1:
            raise ConfigError(f"model.{key}={a[key]} must be >= 1")
    if int(a["depth"]) < 2:
        raise ConfigError(f"model.depth={a['depth']} must be >= 2 (one downsampling at least)")
    if int(a["blocks_deepest"]) < 0:
        raise ConfigError(f"model.blocks_deepest={a['blocks_deepest']} must be >= 0")
    for key, options in (("growth", GROWTH), ("connections", CONNECTIONS),
                         ("downsample", DOWNSAMPLE), ("upsample", UPSAMPLE)):
        if a[key] not in options:
            raise ConfigError(f"model.{key}={a[key]!r}: use one of {', '.join(options)}")
    if a["padding"] != "same":
        raise ConfigError(f"model.padding={a['padding']!r}: UResNet is same-padding only "
                          "(residual sums need equal sizes); use padding=same")
    for key in ("initial_kernel", "deepest_kernel"):
        if int(a[key]) % 2 == 0:
            raise ConfigError(f"model.{key}={a[key]} must be odd (same padding)")
