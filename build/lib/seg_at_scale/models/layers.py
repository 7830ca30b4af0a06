"""A model as a flat list of layers with named skip connections.

Pipeline parallelism (``seg_at_scale.parallel``) and layer-wise activation checkpointing
need a network as a flat sequence. Skip connections (U-Net's encoder-to-decoder
concatenations, ResNet sums, Gated-SCNN's side features) become named values: a
:class:`Skip` layer *stashes* its output under a name, a later one *pops* it as an extra
input. Every model here gives its flat form through ``model.pipeline_layers()``, which
shares the model's own modules (same parameters, same state dict).

This module is plain PyTorch: :func:`run_layers` runs the flat form on one device, and
``seg_at_scale.parallel.pipe`` turns the same list into fairscale's stash/pop layers.

>>> import torch
>>> from torch import nn
>>> layers = [Skip(nn.Identity(), stash=("s",)), nn.Linear(2, 2),
...           Skip(Merge("sum"), pop=("s",))]
>>> x = torch.ones(1, 2)
>>> torch.equal(run_layers(layers, x), layers[1](x) + x)
True
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

__all__ = ["Skip", "Merge", "run_layers", "skip_names", "check_layers", "body_of",
           "is_downsampling", "is_upsampling", "DOWNSAMPLING", "UPSAMPLING"]

#: Layers that shrink (grow) the resolution, whatever their parameters.
DOWNSAMPLING = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d,
                nn.PixelUnshuffle)
UPSAMPLING = (nn.ConvTranspose2d, nn.Upsample, nn.PixelShuffle)


class Skip(nn.Module):
    """A layer with named side inputs and outputs.

    Args:
        body: ``body(x, *popped) -> y``.
        pop: names of stashed values passed to ``body`` after ``x``, in this order.
        stash: names under which ``y`` is stashed for later layers (``y`` also flows on).
    """

    def __init__(self, body: nn.Module, *, pop: Sequence[str] = (),
                 stash: Sequence[str] = ()) -> None:
        super().__init__()
        self.body = body
        self.pop, self.stash = tuple(pop), tuple(stash)

    def forward(self, x: Tensor, *popped: Tensor) -> Tensor:
        return self.body(x, *popped)

    def extra_repr(self) -> str:
        return f"pop={list(self.pop)}, stash={list(self.stash)}"


def _center_crop(x: Tensor, h: int, w: int) -> Tensor:
    dy, dx = (x.shape[-2] - h) // 2, (x.shape[-1] - w) // 2
    return x[..., dy : dy + h, dx : dx + w]


class Merge(nn.Module):
    """Join ``x`` with popped skip values: ``"concat"`` (skips first) or ``"sum"``.

    Skips larger than ``x`` (valid padding) are centre-cropped to it.
    """

    def __init__(self, mode: str = "concat") -> None:
        super().__init__()
        if mode not in ("concat", "sum"):
            raise ValueError(f"Merge mode {mode!r}: use 'concat' or 'sum'")
        self.mode = mode

    def forward(self, x: Tensor, *skips: Tensor) -> Tensor:
        h, w = x.shape[-2], x.shape[-1]
        cropped = [_center_crop(s, h, w) for s in skips]
        if self.mode == "concat":
            return torch.cat([*cropped, x], dim=1)
        for s in cropped:
            x = x + s
        return x

    def extra_repr(self) -> str:
        return self.mode


def run_layers(layers: Iterable[nn.Module], x: Tensor,
               stashed: dict[str, Tensor] | None = None) -> Tensor:
    """Run a flat layer list on one device, carrying named skips.

    With ``stashed`` given (a segment of the list), skips are popped from and stashed into
    it and may stay there for later segments; without it every skip must be popped.
    """
    whole = stashed is None
    stashed = {} if stashed is None else stashed
    for layer in layers:
        if isinstance(layer, Skip):
            x = layer(x, *(stashed.pop(n) for n in layer.pop))
            for n in layer.stash:
                stashed[n] = x
        else:
            x = layer(x)
    if whole and stashed:
        raise RuntimeError(f"skips stashed but never popped: {sorted(stashed)}")
    return x


def skip_names(layers: Sequence[nn.Module]) -> list[str]:
    """All skip names, in stash order."""
    return [n for layer in layers if isinstance(layer, Skip) for n in layer.stash]


def check_layers(layers: Sequence[nn.Module]) -> None:
    """Every popped name is stashed earlier, exactly once, and popped exactly once."""
    live: set[str] = set()
    for i, layer in enumerate(layers):
        if not isinstance(layer, Skip):
            continue
        for n in layer.pop:
            if n not in live:
                raise ValueError(f"layer {i} pops {n!r}, which no earlier layer stashed")
            live.remove(n)
        for n in layer.stash:
            if n in live:
                raise ValueError(f"layer {i} stashes {n!r} again before it was popped")
            live.add(n)
    if live:
        raise ValueError(f"skips stashed but never popped: {sorted(live)}")


def body_of(layer: nn.Module) -> nn.Module:
    """The module a flat layer runs (a :class:`Skip`'s body, else the layer itself)."""
    return layer.body if isinstance(layer, Skip) else layer


def is_downsampling(m: nn.Module) -> bool:
    """Whether ``m`` lowers the resolution (pooling, or a strided convolution)."""
    if isinstance(m, DOWNSAMPLING):
        return True
    return isinstance(m, nn.Conv2d) and not isinstance(m, nn.ConvTranspose2d) and any(
        s > 1 for s in m.stride)


def is_upsampling(m: nn.Module) -> bool:
    """Whether ``m`` (or a module inside it) raises the resolution."""
    return isinstance(m, UPSAMPLING) or any(isinstance(c, UPSAMPLING) for c in m.modules())
