"""Per-layer cost of a model's flat form, measured on one device.

For every layer of ``model.pipeline_layers()``: forward and backward time, the bytes its
forward saves for backward (activation memory), its output bytes (what crosses a stage
boundary, and what a checkpointed stage keeps), the bytes of skips it stashes, and its
parameter bytes. The planner (:mod:`seg_at_scale.parallel.planner`) turns this into
balances and predictions for k devices.

fairscale's own profiler runs the sequential without its skip tracker, so it cannot
profile layers that stash or pop; this one carries the skips itself (as
:func:`~seg_at_scale.models.layers.run_layers` does).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch
from torch import Tensor, nn

from seg_at_scale.models.layers import Skip, run_layers

__all__ = ["LayerCost", "profile_layers"]


@dataclass(frozen=True)
class LayerCost:
    """Measured cost of one layer for one input (a micro-batch of ``batch`` samples)."""

    name: str
    forward_s: float
    backward_s: float
    saved_bytes: int     # tensors saved for backward
    output_bytes: int
    stash_bytes: int     # skips stashed here (alive until their pop)
    param_bytes: int

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_layers(layers: Sequence[nn.Module], sample: Tensor, *, repeats: int = 3,
                   warmup: int = 1) -> list[LayerCost]:
    """Time and size every layer on ``sample``'s device (median over ``repeats``).

    Each layer runs on a detached copy of its real input, so its backward is timed alone;
    the times are then calibrated to the whole network's measured forward and backward.
    """
    device = sample.device
    stashed: dict[str, Tensor] = {}
    x = sample
    costs: list[LayerCost] = []
    for i, layer in enumerate(layers):
        popped = [stashed.pop(n) for n in layer.pop] if isinstance(layer, Skip) else []
        inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in (x, *popped)]
        fwd, bwd = [], []
        saved = 0
        y = x
        for r in range(warmup + repeats):
            seen: dict[int, int] = {}

            def pack(t: Tensor, seen: dict[int, int] = seen) -> Tensor:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            _sync(device)
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = layer(*[t.clone() for t in inputs]) if _inplace(layer) else layer(*inputs)
            _sync(device)
            t1 = time.perf_counter()
            if y.requires_grad:
                y.backward(torch.ones_like(y))
            _sync(device)
            t2 = time.perf_counter()
            if r >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
                saved = sum(seen.values())
            for t in inputs:
                t.grad = None
        layer.zero_grad(set_to_none=True)
        y = y.detach()
        stash_bytes = 0
        if isinstance(layer, Skip):
            for n in layer.stash:
                stashed[n] = y
                stash_bytes += _nbytes(y)
        params = sum(_nbytes(p) for p in layer.parameters())
        costs.append(LayerCost(f"{i}:{type(layer).__name__}", sorted(fwd)[len(fwd) // 2],
                               sorted(bwd)[len(bwd) // 2], saved, _nbytes(y), stash_bytes,
                               params))
        x = y
    return _calibrated(costs, layers, sample, repeats)


def _calibrated(costs: list[LayerCost], layers: Sequence[nn.Module], sample: Tensor,
                repeats: int) -> list[LayerCost]:
    """Scale the layer times so they add up to the whole network's measured step.

    Timing layers one by one adds per-call overhead (an autograd launch per layer, input
    gradients the whole network does not compute) that is large next to a ReLU: the layers'
    *shares* are kept, the totals come from running the flat network whole, forward and
    backward timed apart (median over ``repeats``).
    """
    device = sample.device
    fwd, bwd = [], []
    for r in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        y = run_layers(layers, sample)
        _sync(device)
        t1 = time.perf_counter()
        y.backward(torch.ones_like(y))
        _sync(device)
        t2 = time.perf_counter()
        if r:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    f_scale = sorted(fwd)[len(fwd) // 2] / max(sum(c.forward_s for c in costs), 1e-12)
    b_scale = sorted(bwd)[len(bwd) // 2] / max(sum(c.backward_s for c in costs), 1e-12)
    return [replace(c, forward_s=c.forward_s * f_scale, backward_s=c.backward_s * b_scale)
            for c in costs]


def _inplace(layer: nn.Module) -> bool:
    body = layer.body if isinstance(layer, Skip) else layer
    return bool(getattr(body, "inplace", False))
