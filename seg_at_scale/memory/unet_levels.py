"""Where a U-shaped flat layer list splits into levels, and the blocks of a level.

The geometry of :mod:`seg_at_scale.memory.strips`, pure and small like the tiling's: a
:class:`Level` is one resolution level of the flat layer form (``model.pipeline_layers()``)
with a skip - its encoder part ``E`` ending in the stash, the downsampling, and the decoder
part ``T`` from the upsampling to the pop - and the halos that make a block of it exact: the
sum of the part's convolution radii (2 pixels for an upsampling), in pixels on each side.
A level's feature maps are cut into blocks by :func:`spans` in each direction; a
:class:`Box` is a block's core or its window (the core widened by the halo).

>>> from seg_at_scale.models import UNet
>>> net = UNet(in_channels=1, num_classes=2, levels=3, base_width=4, padding="same")
>>> [(lv.name, lv.halo_enc, lv.halo_top) for lv in find_levels(net.pipeline_layers())]
[('skip0', 2, 6), ('skip1', 2, 6)]
>>> core = Box(8, 16, 0, 12)
>>> win = core.grow(2, 52, 36)
>>> win, core.within(win), core.half()
(Box(r0=6, r1=18, c0=0, c1=14), Box(r0=2, r1=10, c0=0, c1=12), Box(r0=4, r1=8, c0=0, c1=6))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from torch import Tensor, nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.models.layers import Skip, body_of, check_layers, is_downsampling, is_upsampling

__all__ = ["Level", "find_levels", "Box", "spans", "even", "check_block_size"]


@dataclass(frozen=True)
class Level:
    """One stripped level of the flat layer list.

    Attributes:
        start: first layer of the encoder part ``E``.
        stash: the layer stashing the skip (last of ``E``).
        up: first layer of the decoder part ``T`` (the upsampling).
        stop: one past the last layer of ``T``.
        name: the skip's name.
        halo_enc: pixels of context on each side for ``D(E(x))`` (even).
        halo_top: pixels of context on each side for ``T(u, E(x))`` (even).
    """

    start: int
    stash: int
    up: int
    stop: int
    name: str
    halo_enc: int
    halo_top: int

    @property
    def down(self) -> int:
        return self.stash + 1


def even(n: int) -> int:
    """``n`` rounded up to an even number."""
    return n + n % 2


def _radius(layers: Sequence[nn.Module], where: str) -> int:
    """Pixels of context of a run of same-resolution layers, in either direction.

    Conservative: the radii add up, and each layer counts its larger direction.
    """
    r = 0
    for layer in layers:
        for m in layer.modules():
            if isinstance(m, nn.ConvTranspose2d) or isinstance(m, nn.Upsample):
                r += 2  # one pixel at the lower resolution (bilinear), two here
            elif isinstance(m, nn.Conv2d):
                k, d, pad = m.kernel_size, m.dilation, m.padding
                same = pad == "same" or (isinstance(pad, tuple) and all(
                    p == dd * (kk - 1) // 2 for p, dd, kk in zip(pad, d, k)))
                if any(st != 1 for st in m.stride) or not same:
                    raise ConfigError(
                        f"memory.granularity=strips needs stride-1, same-padded convolutions in "
                        f"{where}; found {m}: use memory.granularity=level for this model")
                r += max(dd * (kk - 1) // 2 for dd, kk in zip(d, k))
    return r


def _down_radius(m: nn.Module, name: str) -> int:
    """Pixels beyond a block's core that a factor-2 downsampling of that core reads."""
    def pair(v: Any) -> tuple[int, int]:
        return (int(v[0]), int(v[1])) if isinstance(v, tuple) else (int(v), int(v))

    if not isinstance(m, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)) or isinstance(
            m, nn.ConvTranspose2d) or pair(m.stride) != (2, 2) or isinstance(m.padding, str):
        raise ConfigError(f"memory.granularity=strips: the downsampling after skip {name!r} "
                          f"is {m}; strips need a stride-2 pooling or convolution; use "
                          "memory.granularity=level")
    return max(max(pad, k - 2 - pad, 0)
               for k, pad in zip(pair(m.kernel_size), pair(m.padding)))


def _check_part(layers: Sequence[nn.Module], name: str, where: str, *, up_first: bool) -> None:
    for i, layer in enumerate(layers):
        body = body_of(layer)
        if is_downsampling(body) or (is_upsampling(body) and not (up_first and i == 0)):
            raise ConfigError(f"memory.granularity=strips: {where} changes resolution at "
                              f"{type(body).__name__}; use memory.granularity=level")
        if isinstance(layer, Skip) and set(layer.stash + layer.pop) - {name}:
            raise ConfigError(f"memory.granularity=strips: {where} carries skips other than "
                              f"{name!r}; use memory.granularity=level")


def find_levels(layers: Sequence[nn.Module]) -> list[Level]:
    """The nested levels of a U-shaped flat layer list, outermost first.

    Raises:
        ConfigError: the list is not U-shaped the way strips need (see the module doc).
    """
    check_layers(layers)
    levels: list[Level] = []
    start, stop = 0, len(layers)
    while True:
        stash = next((j for j in range(start, stop)
                      if isinstance(layers[j], Skip) and layers[j].stash), None)
        if stash is None:
            break
        names = cast(Skip, layers[stash]).stash  # a Skip that stashes (found above)
        if len(names) != 1 or stash + 1 >= stop or not is_downsampling(body_of(layers[stash + 1])):
            raise ConfigError(
                f"memory.granularity=strips: layer {stash} stashes {list(names)} but is not "
                "followed by a downsampling layer; use memory.granularity=level")
        name = names[0]
        pop = next(j for j in range(stash + 1, stop)
                   if isinstance(m := layers[j], Skip) and name in m.pop)
        up = max((j for j in range(stash + 2, pop) if is_upsampling(body_of(layers[j]))),
                 default=None)
        if up is None:
            raise ConfigError(f"memory.granularity=strips: no upsampling before skip {name!r} "
                              "is popped; use memory.granularity=level")
        enc, top = layers[start : stash + 1], layers[up:stop]
        _check_part(enc, name, f"the encoder of level {len(levels)}", up_first=False)
        _check_part(top, name, f"the decoder of level {len(levels)}", up_first=True)
        r_enc = _radius(enc, f"level {len(levels)}")
        r_down = _down_radius(body_of(layers[stash + 1]), name)
        levels.append(Level(start, stash, up, stop, name, even(r_enc + r_down),
                            even(r_enc + _radius(top, f"level {len(levels)}"))))
        start, stop = stash + 2, up
    return levels


def check_block_size(rows: object, cols: object) -> None:
    """Refuse block sizes :func:`spans` cannot use (odd, < 2, not whole numbers).

    Raises:
        ConfigError: naming ``memory.strip_rows`` / ``memory.strip_cols`` and the fix.
    """
    if not isinstance(rows, int) or rows < 2 or rows % 2:
        raise ConfigError(f"memory.strip_rows={rows!r}: use an even number of rows >= 2")
    if cols is not None and (not isinstance(cols, int) or cols < 2 or cols % 2):
        raise ConfigError(f"memory.strip_cols={cols!r}: use an even number of columns >= 2, "
                          "or null for whole rows")


def spans(n: int, most: int) -> list[tuple[int, int]]:
    """``[a, b)`` spans covering ``0..n``, as few as ``most`` allows.

    Nearly equal, with even borders (one level down halves them exactly).

    >>> spans(20, 8), spans(36, 36)
    ([(0, 6), (6, 14), (14, 20)], [(0, 36)])
    """
    k = -(-n // most)
    cuts = [2 * round(i * n / (2 * k)) for i in range(k)] + [n]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


@dataclass(frozen=True)
class Box:
    """Rows ``r0:r1`` and columns ``c0:c1`` of a level's feature maps (even borders)."""

    r0: int
    r1: int
    c0: int
    c1: int

    def of(self, t: Tensor) -> Tensor:
        """The box's view of ``t`` ``[..., H, W]``."""
        return t[..., self.r0 : self.r1, self.c0 : self.c1]

    def grow(self, halo: int, h: int, w: int) -> Box:
        """The window: the box widened by ``halo`` on every side, clipped to ``h x w``."""
        return Box(max(0, self.r0 - halo), min(h, self.r1 + halo),
                   max(0, self.c0 - halo), min(w, self.c1 + halo))

    def within(self, win: Box) -> Box:
        """This box in the coordinates of the window ``win`` around it."""
        return Box(self.r0 - win.r0, self.r1 - win.r0, self.c0 - win.c0, self.c1 - win.c0)

    def half(self) -> Box:
        """The same box one level down (half the resolution)."""
        return Box(self.r0 // 2, self.r1 // 2, self.c0 // 2, self.c1 // 2)
