"""Cut a flat layer list into checkpoint segments, and run them carrying named skips.

Activation checkpointing keeps only each segment's *inputs* during the forward pass and
recomputes the segment's inside during the backward pass. On the flat layer form
(``model.pipeline_layers()``, see :mod:`seg_at_scale.models.layers`) a segment is a run of
consecutive layers; the named skips that cross its borders become explicit inputs (skips
it pops that were stashed earlier) and outputs (skips it stashes for later layers), so a
checkpointed segment computes exactly what :func:`~seg_at_scale.models.layers.run_layers`
computes.

Granularities:

* ``"layers"``: every ``k`` layers (generic);
* ``"block"``: one segment per building block, i.e. per direct child of the model's
  containers (``down.0``, ``ups.1``, ``up_blocks.1``, ``head`` for the U-Net), found from
  module ownership, so it works for any model whose blocks are submodules;
* ``"level"``: one segment per resolution level: a new segment starts after every
  downsampling layer (pooling, strided convolution) and at every upsampling layer.

>>> from torch import nn
>>> from seg_at_scale.models.layers import Skip, Merge
>>> layers = [nn.Conv2d(1, 2, 3, padding=1), Skip(nn.ReLU(), stash=("s",)), nn.MaxPool2d(2),
...           nn.Conv2d(2, 2, 3, padding=1), nn.Upsample(scale_factor=2),
...           Skip(Merge("concat"), pop=("s",)), nn.Conv2d(4, 1, 1)]
>>> [s.stop - s.start for s in cut_segments(layers, "level")]
[3, 1, 3]
>>> [s.stop - s.start for s in cut_segments(layers, "layers", every=3)]
[3, 3, 1]
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from seg_at_scale.errors import ConfigError
from seg_at_scale.models.layers import (
    Skip,
    body_of,
    check_layers,
    is_downsampling,
    is_upsampling,
    run_layers,
)

__all__ = ["GRANULARITIES", "Segment", "cut_segments", "run_segments", "keep_norm_stats"]

GRANULARITIES = ("level", "block", "layers")

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)

Move = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class Segment:
    """Layers ``[start, stop)`` of the flat list and the skips crossing its borders.

    Attributes:
        start: first layer index.
        stop: one past the last layer index.
        needs: skip names the segment pops that an earlier segment stashed (extra inputs).
        gives: skip names the segment stashes for a later segment (extra outputs).
    """

    start: int
    stop: int
    needs: tuple[str, ...]
    gives: tuple[str, ...]


def cut_segments(layers: Sequence[nn.Module], granularity: str, *, every: int = 1,
                 owner: nn.Module | None = None) -> list[Segment]:
    """Cut ``layers`` into checkpoint segments.

    Args:
        layers: a flat layer list (``model.pipeline_layers()``).
        granularity: ``"level"``, ``"block"`` or ``"layers"``.
        every: layers per segment for ``"layers"``.
        owner: the model the layers belong to (needed for ``"block"``).

    Returns:
        Segments covering all layers in order.

    Raises:
        ConfigError: unknown granularity or ``every < 1``.
    """
    check_layers(layers)
    n = len(layers)
    if granularity == "layers":
        if every < 1:
            raise ConfigError(f"memory.every={every}: use a whole number of layers >= 1")
        starts = list(range(0, n, every))
    elif granularity == "level":
        starts = _level_starts(layers)
    elif granularity == "block":
        if owner is None:
            raise ConfigError("memory.granularity='block' needs the model (owner) to find blocks")
        starts = _block_starts(layers, owner)
    else:
        raise ConfigError(f"memory.granularity={granularity!r}: use one of {GRANULARITIES}")
    bounds = sorted(set(starts) | {0}) + [n]
    return [_with_skips(layers, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]


def _level_starts(layers: Sequence[nn.Module]) -> list[int]:
    """New segment after each downsampling layer and at each upsampling layer."""
    starts = []
    for i, layer in enumerate(layers):
        body = body_of(layer)
        if is_upsampling(body):
            starts.append(i)
        elif is_downsampling(body):
            starts.append(i + 1)
    return starts


def _block_starts(layers: Sequence[nn.Module], owner: nn.Module) -> list[int]:
    """New segment wherever the owning block changes.

    Layers without an owner (``Merge``) or without parameters (a shared pooling layer)
    join the segment before them: a segment of its own would save nothing.
    """
    block_of: dict[int, str] = {}
    for name, mod in owner.named_modules():
        prefix = _block_name(owner, name)
        if prefix:
            block_of.setdefault(id(mod), prefix)
    starts, current = [], None
    for i, layer in enumerate(layers):
        body = body_of(layer)
        block = block_of.get(id(body))
        has_params = next(body.parameters(), None) is not None
        if block is not None and block != current and (has_params or current is None):
            starts.append(i)
            current = block
    return starts


def _block_name(owner: nn.Module, name: str) -> str:
    """Shortest prefix of ``name`` that is not a plain container (ModuleList, Sequential)."""
    if not name:
        return ""
    parts, mod = name.split("."), owner
    for k, part in enumerate(parts):
        mod = getattr(mod, part) if not part.isdigit() else cast(nn.ModuleList, mod)[int(part)]
        if type(mod) not in _CONTAINERS:
            return ".".join(parts[: k + 1])
    return name


def _with_skips(layers: Sequence[nn.Module], lo: int, hi: int) -> Segment:
    stashed_before = {n for layer in layers[:lo] if isinstance(layer, Skip) for n in layer.stash}
    popped_before = {n for layer in layers[:lo] if isinstance(layer, Skip) for n in layer.pop}
    inside = [layer for layer in layers[lo:hi] if isinstance(layer, Skip)]
    needs = tuple(n for layer in inside for n in layer.pop
                  if n in stashed_before and n not in popped_before)
    popped_inside = {n for layer in inside for n in layer.pop}
    gives = tuple(n for layer in inside for n in layer.stash if n not in popped_inside)
    return Segment(lo, hi, needs, gives)


def _run_plain(layers: Sequence[nn.Module], x: Tensor, stashed: dict[str, Tensor]) -> Tensor:
    return run_layers(layers, x, stashed)


def _segment_fn(layers: Sequence[nn.Module], seg: Segment,
                to_device: Move | None) -> Callable[..., tuple[Tensor, ...]]:
    """``f(x, *needed skips) -> (x, *given skips)`` for one segment."""

    def run(x: Tensor, *needed: Tensor) -> tuple[Tensor, ...]:
        if to_device is not None:
            x, needed = to_device(x), tuple(to_device(t) for t in needed)
        if getattr(body_of(layers[seg.start]), "inplace", False):
            x = x.clone()  # the segment input is kept for recomputation: do not overwrite it
        stashed = dict(zip(seg.needs, needed))
        y = _run_plain(layers[seg.start : seg.stop], x, stashed)
        return (y, *(stashed.pop(n) for n in seg.gives))

    return run


def _contexts(inside: Sequence[nn.Module]
              ) -> tuple[contextlib.AbstractContextManager[None],
                         contextlib.AbstractContextManager[None]]:
    """``checkpoint``'s context_fn: the statistics kept around the segment's recomputation."""
    return contextlib.nullcontext(), keep_norm_stats(inside)


@contextlib.contextmanager
def keep_norm_stats(layers: Sequence[nn.Module]) -> Iterator[None]:
    """Undo what a recomputation does to train-mode BatchNorm running statistics.

    Recomputing a segment runs its BatchNorms' forward a second time; without this their
    running mean / variance would take two momentum updates per step instead of one.
    """
    norms = [m for layer in layers for m in layer.modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    saved = [{k: b.detach().clone() for k, b in m.named_buffers(recurse=False)} for m in norms]
    try:
        yield
    finally:
        for m, buffers in zip(norms, saved):
            for k, b in m.named_buffers(recurse=False):
                b.copy_(buffers[k])


def run_segments(layers: Sequence[nn.Module], segments: Sequence[Segment], x: Tensor, *,
                 checkpoint_last: bool = False, to_host: Move | None = None,
                 to_device: Move | None = None) -> Tensor:
    """Run the flat layers segment by segment, each under non-reentrant checkpointing.

    Args:
        layers: the flat layer list.
        segments: from :func:`cut_segments`.
        x: input ``[B, C, H, W]``.
        checkpoint_last: also checkpoint the last segment (its recomputation would start
            the backward pass at once, so by default it runs plainly: same peak, less time).
        to_host: applied to every tensor kept between segments (segment inputs and stashed
            skips), e.g. a differentiable copy to host memory; ``None`` keeps them in place.
        to_device: applied inside a segment to its inputs (the way back from ``to_host``).

    Returns:
        The output, equal to ``run_layers(layers, x)``.
    """
    stashed: dict[str, Tensor] = {}
    for k, seg in enumerate(segments):
        needed = tuple(stashed.pop(n) for n in seg.needs)
        last = k == len(segments) - 1
        if last and not checkpoint_last:
            if to_device is not None:
                x, needed = to_device(x), tuple(to_device(t) for t in needed)
            stashed.update(zip(seg.needs, needed))
            x = _run_plain(layers[seg.start : seg.stop], x, stashed)
            continue
        if to_host is not None:
            x, needed = to_host(x), tuple(to_host(t) for t in needed)
        inside = layers[seg.start : seg.stop]
        out = checkpoint(_segment_fn(layers, seg, to_device), x, *needed, use_reentrant=False,
                         context_fn=functools.partial(_contexts, inside))
        x = out[0]
        for name, t in zip(seg.gives, out[1:]):
            stashed[name] = to_host(t) if to_host is not None else t
    if stashed:
        raise RuntimeError(f"skips stashed but never popped: {sorted(stashed)}")
    return x
