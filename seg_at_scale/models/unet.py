"""U-Net (Ronneberger et al. 2015) in the configurations the seeds used.

``padding="valid"`` is the 2015 paper: 572 x 572 in, 388 x 388 out for five levels of
two 3 x 3 convolutions; ``padding="same"`` keeps the size. With ``norm="none"`` the
network has no whole-image statistics, so halo tiling is exact (``docs/design.md``).

>>> net = UNet(in_channels=1, num_classes=2, levels=5, convs_per_level=2, base_width=4,
...            padding="valid")
>>> net(torch.zeros(1, 1, 572, 572)).shape[-2:], net.footprint().halo
(torch.Size([388, 388]), 92)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import Tensor, nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.models.layers import Merge, Skip
from seg_at_scale.tiling.geometry import Footprint
from seg_at_scale.tiling.statistic_layers import GroupNormSite

__all__ = ["UNet", "UNetSize", "UNET_SIZES"]

Norm = Literal["none", "batch", "group"]
Upsample = Literal["transpose", "nearest", "bilinear"]


@dataclass(frozen=True)
class UNetSize:
    """Width and depth of a U-Net preset."""

    levels: int
    convs_per_level: int
    base_width: int


UNET_SIZES: dict[str, UNetSize] = {
    "tiny": UNetSize(levels=3, convs_per_level=2, base_width=8),
    "small": UNetSize(levels=4, convs_per_level=2, base_width=16),
    "medium": UNetSize(levels=5, convs_per_level=2, base_width=32),
    "large": UNetSize(levels=5, convs_per_level=2, base_width=64),  # the 2015 U-Net
}


def _norm(kind: Norm, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":  # a statistic site: prediction computes its whole-image statistics
        return GroupNormSite(min(8, channels), channels)
    return nn.Identity()


class ConvBlock(nn.Sequential):
    """``n`` times (3 x 3 conv, norm, ReLU)."""

    def __init__(self, cin: int, cout: int, n: int, padding: int, norm: Norm) -> None:
        layers: list[nn.Module] = []
        for k in range(n):
            layers += [
                nn.Conv2d(cin if k == 0 else cout, cout, 3, padding=padding, bias=norm == "none"),
                _norm(norm, cout),
                nn.ReLU(inplace=True),
            ]
        super().__init__(*layers)


class Up(nn.Module):
    """Double the resolution and halve the channels."""

    def __init__(self, cin: int, cout: int, mode: Upsample) -> None:
        super().__init__()
        self.mode = mode
        if mode == "transpose":
            self.up: nn.Module = nn.ConvTranspose2d(cin, cout, 2, stride=2)
        else:
            self.up = nn.Sequential(
                nn.Upsample(scale_factor=2, mode=mode,
                            **({"align_corners": False} if mode == "bilinear" else {})),
                nn.Conv2d(cin, cout, 1),
            )

    def forward(self, x: Tensor) -> Tensor:
        return self.up(x)


def _center_crop(x: Tensor, h: int, w: int) -> Tensor:
    dy, dx = (x.shape[-2] - h) // 2, (x.shape[-1] - w) // 2
    return x[..., dy : dy + h, dx : dx + w]


class UNet(nn.Module):
    """Encoder-decoder with skip connections.

    Args:
        in_channels: input bands.
        num_classes: output channels (logits).
        levels: resolution levels L (L - 1 poolings); downsampling factor 2^(L-1).
        convs_per_level: 3 x 3 convolutions per level, n_c.
        base_width: channels at the first level; doubled at every level.
        padding: ``"valid"`` (2015 paper, output smaller than input) or ``"same"``.
        norm: ``"none"`` (exact tiling), ``"batch"`` or ``"group"`` (a statistic site: tiled
            prediction computes its whole-image statistics in extra passes; same padding).
            In train mode neither is tile-exact (docs/design.md, "Where exactness does not
            hold").
        upsample: ``"transpose"`` (2 x 2 transposed conv), ``"nearest"`` or ``"bilinear"``
            (interpolation then 1 x 1 conv; bilinear needs ``same`` padding).

    Shapes:
        ``[B, in_channels, H, W] -> [B, num_classes, H', W']`` with ``H' = H`` (same) or
        ``H' = H - 2 * halo`` (valid; H must be a valid size, see :meth:`valid_input_size`).
    """

    def __init__(self, in_channels: int = 4, num_classes: int = 5, levels: int = 5,
                 convs_per_level: int = 2, base_width: int = 64, padding: str = "valid",
                 norm: str = "none", upsample: str = "transpose") -> None:
        super().__init__()
        _check_args(levels, convs_per_level, base_width, padding, norm, upsample)
        self.in_channels, self.num_classes = in_channels, num_classes
        self.levels, self.convs_per_level, self.base_width = levels, convs_per_level, base_width
        self.padding, self.norm, self.upsample = padding, norm, upsample
        pad = 1 if padding == "same" else 0
        norm_kind, up_kind = cast(Norm, norm), cast(Upsample, upsample)  # checked above
        widths = [base_width * 2**k for k in range(levels)]
        self.down = nn.ModuleList()
        cin = in_channels
        for w in widths:
            self.down.append(ConvBlock(cin, w, convs_per_level, pad, norm_kind))
            cin = w
        self.pool = nn.MaxPool2d(2)
        self.ups = nn.ModuleList()
        self.up_blocks = nn.ModuleList()
        for w in reversed(widths[:-1]):
            self.ups.append(Up(2 * w, w, up_kind))
            self.up_blocks.append(ConvBlock(2 * w, w, convs_per_level, pad, norm_kind))
        self.head = nn.Conv2d(widths[0], num_classes, 1)

    @property
    def downsampling_factor(self) -> int:
        return 2 ** (self.levels - 1)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[B, num_classes, H', W']`` for images ``[B, in_channels, H, W]``."""
        skips = []
        for k, block in enumerate(self.down):
            x = block(x)
            if k < self.levels - 1:
                skips.append(x)
                x = self.pool(x)
        for up, block, skip in zip(self.ups, self.up_blocks, reversed(skips)):
            x = up(x)
            x = torch.cat([_center_crop(skip, x.shape[-2], x.shape[-1]), x], dim=1)
            x = block(x)
        return self.head(x)

    def pipeline_layers(self) -> list[nn.Module]:
        """The network as a flat layer list (one entry per conv, ReLU, pool, ...).

        Encoder level ``k`` stashes its output as ``skip{k}``; the decoder pops it. The
        layers are this model's own modules, so ``run_layers(net.pipeline_layers(), x)``
        equals ``net(x)`` exactly.
        """
        layers: list[nn.Module] = []
        for k, block in enumerate(self.down):
            body = [m for m in cast(ConvBlock, block) if not isinstance(m, nn.Identity)]
            if k < self.levels - 1:
                layers += body[:-1] + [Skip(body[-1], stash=(f"skip{k}",)), self.pool]
            else:
                layers += body
        for j, (up, block) in enumerate(zip(self.ups, self.up_blocks)):
            k = self.levels - 2 - j
            layers += [up, Skip(Merge("concat"), pop=(f"skip{k}",))]
            layers += [m for m in cast(ConvBlock, block) if not isinstance(m, nn.Identity)]
        return layers + [self.head]

    # ----- geometry (analytic) -----------------------------------------------------------

    def output_size(self, size: int) -> int:
        """Output length for an input length (raises if the size is not valid)."""
        shrink = 2 * self.convs_per_level * (self.padding == "valid")
        s = size
        enc = []
        for k in range(self.levels):
            s -= shrink
            if s < 1 or (k < self.levels - 1 and s % 2):
                raise ConfigError(
                    f"input size {size} does not survive the U-Net's poolings (level {k + 1}); "
                    f"use valid_input_size({size}) = {self.valid_input_size(max(size, 1))}")
            enc.append(s)
            if k < self.levels - 1:
                s //= 2
        for k in range(self.levels - 2, -1, -1):
            s = 2 * s - shrink
            if s < 1 or s > enc[k]:
                raise ConfigError(f"input size {size} is too small for this U-Net")
        return s

    def valid_input_size(self, size: int) -> int:
        """Smallest input length >= ``size`` the network accepts."""
        d = self.downsampling_factor
        if self.padding == "same":
            return -(-size // d) * d
        base = 2 * self.convs_per_level * (d - 1)  # input = d * m + base
        m = max(-(-(size - base) // d), 2 * self.convs_per_level + 1)
        while True:
            try:
                self.output_size(d * m + base)
                return d * m + base
            except ConfigError:
                m += 1

    def footprint(self) -> Footprint:
        """Halo, alignment and size rule, computed analytically (see :func:`input_span`)."""
        d = self.downsampling_factor
        if self.padding == "valid":
            halo = self.convs_per_level * (3 * d - 2)  # = (3*2^(L-2) - 1) * 2 * n_c
            s = self.valid_input_size(1)
            return Footprint(halo, d, "valid", (self.output_size(s)) % d)
        return Footprint(same_padding_halo(self), d, "same", 0)


def same_padding_halo(net: UNet) -> int:
    """Aligned halo of a same-padding U-Net, by interval arithmetic.

    Walks the architecture backwards from each output pixel of one aligned block of
    ``d = 2^(L-1)`` pixels and returns how far their receptive fields reach past the block.
    """
    d = net.downsampling_factor
    base = 4 * d * (net.levels + 1) * net.convs_per_level  # aligned, far from any border
    lo, hi = _decoder_span(net, 0, base, base + d - 1)
    return max(base - lo, hi - (base + d - 1))


def _conv_back(lo: int, hi: int, n: int) -> tuple[int, int]:
    return lo - n, hi + n  # n same-padded 3 x 3 convolutions


def _up_back(lo: int, hi: int, mode: str) -> tuple[int, int]:
    if mode == "bilinear":  # align_corners=False: out i reads floor(i/2 - 1/4) and the next
        return (2 * lo - 1) // 4, (2 * hi - 1) // 4 + 1
    return lo // 2, hi // 2


def _encoder_span(net: UNet, level: int, lo: int, hi: int) -> tuple[int, int]:
    lo, hi = _conv_back(lo, hi, net.convs_per_level)
    if level == 0:
        return lo, hi
    return _encoder_span(net, level - 1, 2 * lo, 2 * hi + 1)  # 2 x 2 max-pool


def _decoder_span(net: UNet, level: int, lo: int, hi: int) -> tuple[int, int]:
    if level == net.levels - 1:
        return _encoder_span(net, level, lo, hi)
    lo, hi = _conv_back(lo, hi, net.convs_per_level)
    s_lo, s_hi = _encoder_span(net, level, lo, hi)
    u_lo, u_hi = _decoder_span(net, level + 1, *_up_back(lo, hi, net.upsample))
    return min(s_lo, u_lo), max(s_hi, u_hi)


def _check_args(levels: int, n_c: int, width: int, padding: str, norm: str, up: str) -> None:
    if levels < 1 or n_c < 1 or width < 1:
        raise ConfigError(f"model.levels, convs_per_level, base_width must be >= 1, got "
                          f"{levels}, {n_c}, {width}")
    if padding not in ("valid", "same"):
        raise ConfigError(f"model.padding={padding!r}: use 'valid' or 'same'")
    if norm not in ("none", "batch", "group"):
        raise ConfigError(f"model.norm={norm!r}: use 'none', 'batch' or 'group'")
    if up not in ("transpose", "nearest", "bilinear"):
        raise ConfigError(f"model.upsample={up!r}: use 'transpose', 'nearest' or 'bilinear'")
    if norm == "group" and padding == "valid":
        raise ConfigError("model.norm='group' with model.padding='valid': GroupNorm's "
                          "whole-image statistics are tiled exactly for same padding only; use "
                          "model.padding=same, or model.norm=none or batch")
    if up == "bilinear" and padding == "valid":
        raise ConfigError("model.upsample='bilinear' clamps at borders, which a valid-padding "
                          "U-Net cannot crop exactly; use upsample='transpose' or padding='same'")
