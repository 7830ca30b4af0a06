"""``tile_size=auto``: the largest tile, or the whole image, that the device's memory holds.

A prediction's tile costs the network's memory for one window: a fixed part (weights
aside: workspace, small maps) and a part per input pixel (the feature maps). Both are
measured once per network, device, precision, layout and bands by three forwards at small
sides (:func:`measured_memory`; an image no larger than the smallest of them is not measured:
it runs as one tile), on a GPU
``torch.cuda.max_memory_allocated``, on the CPU every tensor the forward creates
(:class:`~seg_at_scale.tiling.staged.peak_memory.LiveMemory`). The tile is then the largest
legal side whose window fits a share of the device's memory; when the window covering the
whole image fits, the image runs as one tile, untiled. On a CPU the tile grows only until
its halo costs 10 % more work (:func:`enough_side`): per-pixel work gains nothing from a
larger tile there, which only costs fresh pages and the overlap of reading with computing.

The share is of the device's *total* memory (a GPU's, or the host's RAM under its cgroup
limit, split between the processes of a host), not of what happens to be free: the same
command on the same machine picks the same tile, so an interrupted prediction resumes into
its own store. Large sides are rounded down to a multiple of :data:`STEP` for the same
reason (a GPU's measured peak varies by a few bytes between runs).

>>> mem = TileMemory(fixed=1e6, per_side=0.0, per_pixel=400.0)
>>> from seg_at_scale.tiling.geometry import Footprint
>>> fp = Footprint(halo=20, align=16)
>>> fit_side(fp, 3000, 5000, mem, budget=2 << 30)  # 2 GiB: 5.3 Mpix, a 2304 tile
2304
>>> fit_side(fp, 600, 500, mem, budget=2 << 30)  # the whole image fits: one tile
672
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from seg_at_scale.devices import module_device
from seg_at_scale.errors import ConfigError
from seg_at_scale.tiling.geometry import Footprint
from seg_at_scale.tiling.staged.peak_memory import LiveMemory
from seg_at_scale.tiling.tile_sides import covering_side, legal_side, smallest_side

__all__ = ["TileMemory", "tile_memory", "measured_memory", "auto_side", "probe_sides",
           "device_memory", "memory_budget", "fit_side", "enough_side", "device_cap",
           "CPU_SHARE", "GPU_SHARE", "STEP"]

#: the share of the host's RAM one prediction's tiles may take (the reader's windows, the
#: store's chunks and the rest of the process live beside them)
CPU_SHARE = 0.25
#: the share of a GPU's memory (the pinned double buffers, cuDNN's workspace, fragmentation)
GPU_SHARE = 0.6
#: sides above 4 x STEP are rounded down to a multiple of it
STEP = 256
#: on a CPU, the tile stops growing once its halo costs at most 10 % more work ...
CPU_OVERHEAD = 1.1
#: ... or at this side, whichever is larger (see :func:`enough_side`)
CPU_FLOOR = 1024


@dataclass(frozen=True)
class TileMemory:
    """Bytes a square window takes: ``fixed + per_side * side + per_pixel * side**2``.

    For a batch of 1; a valid-padding network's maps shrink by a few pixels per layer (the
    linear term).
    """

    fixed: float
    per_side: float
    per_pixel: float

    def bytes(self, rows: int, cols: int | None = None, batch: int = 1) -> float:
        """Bytes of a ``rows x cols`` window (square when ``cols`` is None)."""
        cols = rows if cols is None else cols
        return self.fixed + batch * (self.per_side * (rows + cols) / 2
                                     + self.per_pixel * rows * cols)

    def largest_side(self, budget: float, batch: int = 1) -> int:
        """The largest square side within ``budget`` bytes (0 when none is)."""
        a, b, c = batch * self.per_pixel, batch * self.per_side, self.fixed - budget
        if c >= 0:
            return 0
        if a <= 0:
            return int(-c / b) if b > 0 else 1 << 20
        return int((-b + math.sqrt(b * b - 4 * a * c)) / (2 * a))


def probe_sides(fp: Footprint) -> list[int]:
    """The three sides :func:`tile_memory` runs the network at."""
    lo = legal_side(fp, max(smallest_side(fp), 96))
    step = legal_side(fp, lo + max(96, 2 * fp.align)) - lo
    return [lo, lo + step, lo + 2 * step]


def tile_memory(model: nn.Module, bands: int, fp: Footprint, *,
                autocast: torch.dtype | None = None, channels_last: bool = False
                ) -> TileMemory:
    """Measure what a window of ``model`` holds, at three small sides, where it lives."""
    device = module_device(model)
    sides = probe_sides(fp)
    lo, step = sides[0], sides[1] - sides[0]
    peaks = [_peak(model, bands, side, device, autocast, channels_last) for side in sides]
    # the quadratic through the three points (divided differences)
    d1 = (peaks[1] - peaks[0]) / step
    d2 = (peaks[2] - peaks[1]) / step
    per_pixel = max(0.0, (d2 - d1) / (2 * step))
    per_side = d1 - per_pixel * (sides[0] + sides[1])  # negative where maps shrink
    fixed = peaks[0] - per_side * lo - per_pixel * lo * lo
    return TileMemory(fixed, per_side, per_pixel)


#: what a window of each network holds, by (device, precision, layout, bands): measured once
_MEASURED: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], TileMemory]] = \
    weakref.WeakKeyDictionary()


def measured_memory(model: nn.Module, bands: int, fp: Footprint, *,
                    autocast: torch.dtype | None = None, channels_last: bool = False
                    ) -> TileMemory:
    """:func:`tile_memory`, measured once per network, device, precision, layout and bands."""
    key = (str(module_device(model)), autocast, channels_last, bands)
    per_model = _MEASURED.setdefault(model, {})
    if key not in per_model:
        per_model[key] = tile_memory(model, bands, fp, autocast=autocast,
                                     channels_last=channels_last)
    return per_model[key]


def auto_side(model: nn.Module, fp: Footprint, height: int, width: int, bands: int, *,
              autocast: torch.dtype | None = None, channels_last: bool = False,
              batch: int = 1, processes_per_device: int = 1) -> int:
    """``tile_size=auto``: the tile side of an image on the model's device.

    :func:`covering_side` when the image runs as one tile. An image no larger than the
    smallest probe runs as one tile without measuring: the probe would run a larger forward
    than the image's own (on a CPU, seconds for a wide encoder whose halo makes the probes
    large).
    """
    device = module_device(model)
    cap = device_cap(fp, device)
    cover = covering_side(fp, height, width)
    if batch == 1 and cover <= probe_sides(fp)[0] and (cap is None or cover <= cap):
        return cover
    memory = measured_memory(model, bands, fp, autocast=autocast, channels_last=channels_last)
    return fit_side(fp, height, width, memory, memory_budget(device, processes_per_device),
                    batch=batch, cap=cap)


def _peak(model: nn.Module, bands: int, side: int, device: torch.device,
          autocast: torch.dtype | None, channels_last: bool) -> float:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    ctx = torch.autocast(device.type, dtype=autocast, enabled=autocast is not None)
    with torch.inference_mode(), ctx:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            x = torch.zeros(1, bands, side, side, device=device).contiguous(memory_format=fmt)
            model(x)
            torch.cuda.synchronize(device)
            return float(torch.cuda.max_memory_allocated(device) - base)
        with LiveMemory() as mem:
            x = torch.zeros(1, bands, side, side, device=device).contiguous(memory_format=fmt)
            model(x)
        return float(mem.peak)


def device_memory(device: torch.device | str) -> int:
    """Bytes of memory of ``device``: a GPU's total, or the host's RAM (cgroup-limited)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in (Path("/sys/fs/cgroup/memory.max"),
                  Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return int(total)


def device_cap(fp: Footprint, device: torch.device | str) -> int | None:
    """The largest side worth taking on ``device``: :func:`enough_side` on a CPU, else none."""
    return None if torch.device(device).type == "cuda" else enough_side(fp)


def memory_budget(device: torch.device | str, processes_per_device: int = 1) -> int:
    """Bytes one process's tiles may take on ``device`` (see :data:`CPU_SHARE`)."""
    device = torch.device(device)
    share = GPU_SHARE if device.type == "cuda" else CPU_SHARE
    return int(device_memory(device) * share / max(1, processes_per_device))


def enough_side(fp: Footprint, overhead: float = CPU_OVERHEAD, floor: int = CPU_FLOOR) -> int:
    """The smallest legal side whose halo costs at most ``overhead`` - 1 of the work.

    An interior tile computes ``(side / core) ** 2`` times its core; at least ``floor``.
    On a CPU the work is per pixel: a larger tile saves no time, its maps only cost fresh
    pages (and the reading of the next tile no longer overlaps the network).
    """
    ratio = math.sqrt(overhead)
    want = max(floor, math.ceil(2 * fp.context * ratio / (ratio - 1)))
    side = legal_side(fp, want)
    return side if side >= want else side + fp.align  # legal sides step by align


def fit_side(fp: Footprint, height: int, width: int, memory: TileMemory, budget: int, *,
             batch: int = 1, cap: int | None = None) -> int:
    """The tile side for an ``height x width`` image within ``budget`` bytes.

    The side covering the whole image when its window fits (and is at most ``cap``), else
    the largest legal side that fits, at most ``cap`` (rounded down to :data:`STEP` when
    large).

    Raises:
        ConfigError: not even the smallest tile fits the budget.
    """
    cover = covering_side(fp, height, width)
    if cap is not None and cap < cover:
        budget = min(budget, int(memory.bytes(cap, batch=batch)))
    rows, cols = min(cover, height + 2 * fp.context + fp.align), \
        min(cover, width + 2 * fp.context + fp.align)
    if memory.bytes(rows, cols, batch) <= budget:
        return cover
    side = legal_side(fp, memory.largest_side(budget, batch))
    if side > 4 * STEP:
        side = legal_side(fp, side // STEP * STEP)
    if memory.bytes(side, batch=batch) > budget:
        need = memory.bytes(smallest_side(fp), batch=batch) / 2**20
        raise ConfigError(f"tile_size=auto: the smallest tile of this network needs "
                          f"{need:.0f} MiB but the device allows {budget / 2**20:.0f} MiB; "
                          "give tile_size=<pixels>, or predict with staged=true")
    return min(side, cover)
