"""Checkpointing by building block, for networks without a flat layer form.

A network built from a library (smp's U-Net, FPN or DeepLabV3+ on a torchvision or timm
encoder) has no ``pipeline_layers()``, but it is made of building blocks: ResNet stages
and residual blocks, ConvNeXt blocks, decoder blocks. :func:`find_units` finds them under
the roots the model names (``model.checkpoint_roots()``: encoder and decoder), and
:func:`checkpointed` runs the network with every unit's forward under non-reentrant
activation checkpointing: a unit keeps only its inputs during the forward pass and is
recomputed in the backward pass. The modules are the model's own (same parameters, same
state dict); nothing changes outside the ``with`` block.

Granularities:

* ``"level"``: one unit per stage: the children of each root made of modules that hold
  weights, ``ModuleList`` / ``ModuleDict`` containers opened (ResNet ``layer1`` ...
  ``layer4``, timm ``stages_0`` ..., the decoder's blocks);
* ``"block"``: one unit per building block: the deepest modules made of modules that hold
  weights, whose parent is a container (``Sequential`` / ``ModuleList`` / ``ModuleDict``):
  residual blocks, ConvNeXt blocks, decoder blocks, ASPP branches.

Leaves outside any unit (a stem convolution, an upsampling) run as they are.

>>> import torch
>>> from torch import nn
>>> stage = nn.Sequential(nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU()),
...                       nn.Sequential(nn.Conv2d(2, 1, 3, padding=1), nn.ReLU()))
>>> root = nn.Module(); root.stem = nn.Conv2d(1, 1, 1); root.stage = stage
>>> [type(u).__name__ for u in find_units([root], "level")]
['Sequential']
>>> len(find_units([root], "block"))
2
>>> x = torch.randn(1, 1, 9, 7, requires_grad=True)
>>> with checkpointed(find_units([root], "block")):
...     y = stage(x)
>>> torch.allclose(y, stage(x))
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from seg_at_scale.memory.segments import keep_norm_stats

__all__ = ["UNIT_GRANULARITIES", "find_units", "checkpointed"]

UNIT_GRANULARITIES = ("level", "block")
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_OPEN = (nn.ModuleList, nn.ModuleDict)


def _is_block(m: nn.Module) -> bool:
    """Made of modules, and holding weights (not an activation wrapper)."""
    return next(m.children(), None) is not None and next(m.parameters(), None) is not None


def _stages(root: nn.Module) -> Iterator[nn.Module]:
    for child in root.children():
        if isinstance(child, _OPEN):
            yield from _stages(child)
        elif _is_block(child):
            yield child


def _blocks(module: nn.Module, in_container: bool) -> list[nn.Module]:
    inner = [u for child in module.children()
             for u in _blocks(child, isinstance(module, _CONTAINERS))]
    if inner:
        return inner
    return [module] if in_container and _is_block(module) else []


def find_units(roots: Sequence[nn.Module], granularity: str) -> list[nn.Module]:
    """The modules to checkpoint under ``roots``, in module order, none inside another.

    Args:
        roots: where to look (an smp model's encoder and decoder), none inside another.
        granularity: ``"level"`` (stages) or ``"block"`` (building blocks).

    Returns:
        The units; ``[]`` when none is found.
    """
    if granularity not in UNIT_GRANULARITIES:
        raise ValueError(f"granularity {granularity!r}: use one of {UNIT_GRANULARITIES}")
    found: list[nn.Module] = []
    for root in roots:
        found += list(_stages(root)) if granularity == "level" else _blocks(root, False)
    return found


def _recomputed(unit: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False,
                          context_fn=lambda: (contextlib.nullcontext(), keep_norm_stats([unit])),
                          **kwargs)

    return run


@contextlib.contextmanager
def checkpointed(units: Sequence[nn.Module]) -> Iterator[None]:
    """Within the block, each unit's forward runs under activation checkpointing.

    The recomputation in the backward pass calls the unit's own forward, so it may run
    after the block has ended; train-mode BatchNorm running statistics take one momentum
    update per step, not two (:func:`~seg_at_scale.memory.segments.keep_norm_stats`).
    """
    before = [unit.__dict__.get("forward") for unit in units]
    for unit in units:
        unit.forward = _recomputed(unit, unit.forward)
    try:
        yield
    finally:
        for unit, own in zip(units, before):
            if own is None:
                del unit.forward
            else:
                unit.forward = own
