"""``tiling.tile_size=auto``: the largest tile a memory budget allows, for the entry points.

The training CLI reads its config and calls these with plain values: :func:`memory_config`
turns the ``memory`` group into a :class:`~seg_at_scale.memory.modes.MemoryConfig`,
:func:`auto_tile` runs the largest-tile search for the run's model, mode, precision and
batch, capped at the side that covers the largest scene in one tile (past it E cannot
improve), and says which tiling keys to set.

>>> memory_config({"mode": "checkpoint", "granularity": "block", "budget_gb": 6}).granularity
'block'
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import torch
from torch import nn

from seg_at_scale.config_check import known_keys
from seg_at_scale.errors import ConfigError
from seg_at_scale.memory.largest_tile import GIB, TileSearch, find_largest_tile
from seg_at_scale.memory.modes import MemoryConfig
from seg_at_scale.memory.probe import StepSpec
from seg_at_scale.tiling.geometry import Footprint
from seg_at_scale.tiling.tile_sides import core_side, covering_side, smallest_side

__all__ = ["memory_config", "auto_tile", "covering_side", "SEARCH_KEYS"]

SEARCH_KEYS = ("budget_gb", "rel_tol", "max_probes")  # keys of the group used by the search


def memory_config(values: Mapping[str, Any] | None) -> MemoryConfig:
    """The ``memory`` config group as a :class:`MemoryConfig` (search keys left out)."""
    known = {f.name for f in fields(MemoryConfig)}
    values = known_keys("memory", values or {}, [*known, *SEARCH_KEYS])
    return MemoryConfig(**{k: v for k, v in values.items() if k in known})


def auto_tile(model: nn.Module, fp: Footprint, memory: MemoryConfig, *,
              budget_gb: float | None, batch: int = 1, precision: str = "32-true",
              channels_last: bool = False, max_side: int = 32768,
              device: str | torch.device = "cpu", rel_tol: float = 0.05,
              max_probes: int = 8, host_rss: int | None = None,
              ) -> tuple[TileSearch, dict[str, int]]:
    """Search the largest tile within ``budget_gb`` and the tiling keys it sets.

    Args:
        model: the plain network (CPU).
        fp: the footprint the run tiles with.
        memory: the memory mode.
        budget_gb: memory budget in GiB (``memory.budget_gb``).
        batch: tiles per training step (``tiling.batch_size`` in random mode).
        precision: Lightning precision of the run.
        channels_last: the task's input layout.
        max_side: largest side worth trying (see :func:`covering_side`).
        device: where the run trains.
        rel_tol: search tolerance (fraction of the side).
        max_probes: most measured steps.
        host_rss: resident size of the training process (CPU), see :func:`find_largest_tile`.

    Returns:
        ``(search, {"tile_size": side, "core_size": core})``.

    Raises:
        ConfigError: no or a non-positive budget, or a budget below the smallest tile's need.
    """
    if budget_gb is None:
        raise ConfigError("tiling.tile_size=auto needs a memory budget: set memory.budget_gb "
                          "(GiB, e.g. memory.budget_gb=6) or give tiling.tile_size as a number")
    if not isinstance(budget_gb, (int, float)) or budget_gb <= 0:
        raise ConfigError(f"memory.budget_gb={budget_gb!r}: use a positive number of GiB")
    spec = StepSpec(memory, batch=batch, precision=precision, channels_last=channels_last)
    cap = max(max_side, smallest_side(fp))
    search = find_largest_tile(model, int(budget_gb * GIB), spec, device=device, max_side=cap,
                               rel_tol=rel_tol, max_probes=max_probes, host_rss=host_rss)
    return search, {"tile_size": search.side, "core_size": core_side(fp, search.side)}
