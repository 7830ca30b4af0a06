"""Large-model support: memory modes, precision checks, the largest tile a budget allows.

* :func:`apply_memory_mode` - ``none`` / ``checkpoint`` / ``offload`` / ``checkpoint_offload``
  for any model with ``pipeline_layers()`` (or, for smp, ``checkpoint_roots()``); same
  parameters and state dict.
* :func:`check_precision` - ``32`` / ``bf16-mixed`` / ``16-mixed`` against the machine.
* :func:`find_largest_tile` - largest aligned square tile whose training step fits a budget.
* :class:`MemoryReport` - per-step peak memory and step time in the run log.
"""

from typing import TYPE_CHECKING

from seg_at_scale.memory.auto import auto_tile, covering_side, memory_config
from seg_at_scale.memory.largest_tile import GIB, TileSearch, find_largest_tile
from seg_at_scale.memory.modes import (
    MODES,
    MemoryConfig,
    MemoryWrapped,
    apply_memory_mode,
    memory_mode_of,
    pipe_checkpoint_mode,
)
from seg_at_scale.memory.precision import check_precision, normalize_precision
from seg_at_scale.memory.probe import StepMeasure, StepSpec, measure_step

if TYPE_CHECKING:  # imported on first use (__getattr__)
    from seg_at_scale.memory.report import MemoryReport, peak_memory_mib

__all__ = [
    "GIB", "MODES", "MemoryConfig", "MemoryReport", "MemoryWrapped", "StepMeasure", "StepSpec",
    "TileSearch", "apply_memory_mode", "auto_tile", "check_precision", "covering_side",
    "find_largest_tile", "measure_step", "memory_config", "memory_mode_of",
    "normalize_precision", "peak_memory_mib", "pipe_checkpoint_mode",
]


def __getattr__(name: str) -> object:
    # The Lightning callback is imported on first use: the largest-tile search's child
    # processes import this package, and Lightning would add seconds and ~100 MB to each.
    if name in ("MemoryReport", "peak_memory_mib"):
        from seg_at_scale.memory import report

        return getattr(report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
