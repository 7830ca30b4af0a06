"""The largest square tile whose training step fits a memory budget.

Peak memory of a step grows like ``base + c * side^2`` (the model, optimiser state and
runtime, plus activations proportional to the tile's pixels). The search uses that model
to *propose* sides and measurements (:func:`~seg_at_scale.memory.probe.measure_step`) to
*decide*: it measures the smallest legal tile (which gives ``base``, and an error when
even that does not fit), then repeatedly fits the line through the two nearest
measurements around the budget, jumps to the side it predicts, and keeps a bracket
``[largest side that fitted, smallest side that did not]`` until the bracket is narrower
than ``rel_tol``. Sides are legal aligned window sides (:mod:`seg_at_scale.tiling.tile_sides`);
steps that pass the budget are stopped early, so failed probes are cheap.

The answer minimises the halo overhead E: fewer, larger tiles re-read less halo.

    search = find_largest_tile(net, 6 * 2**30, StepSpec(MemoryConfig("checkpoint")))
    search.side, search.peak_bytes
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.memory.probe import StepMeasure, StepSpec, measure_step, probe_server
from seg_at_scale.models.contract import SegmentationNetwork
from seg_at_scale.tiling.geometry import Footprint
from seg_at_scale.tiling.halo import footprint
from seg_at_scale.tiling.tile_sides import legal_side, smallest_side

__all__ = ["TileSearch", "find_largest_tile", "activation_bytes_per_pixel", "GIB"]

log = logging.getLogger(__name__)

GIB = 2**30
Measure = Callable[[int], StepMeasure]


@dataclass
class TileSearch:
    """Result of a largest-tile search.

    Attributes:
        side: the largest legal window side measured to fit.
        peak_bytes: its measured peak.
        budget_bytes: the budget.
        probes: every measurement, in the order taken.
        bytes_per_pixel: fitted activation bytes per input pixel (the ``c`` of the model).
        reserve_bytes: what the training process holds beyond a bare step process (CPU),
            counted against the budget beside the peak.
    """

    side: int
    peak_bytes: int
    budget_bytes: int
    probes: list[StepMeasure] = field(default_factory=list)
    bytes_per_pixel: float = float("nan")
    reserve_bytes: int = 0

    def summary(self) -> str:
        held = (f" + {self.reserve_bytes / GIB:.2f} GiB held by the training process itself"
                if self.reserve_bytes else "")
        return (f"largest tile {self.side}^2: peak {self.peak_bytes / GIB:.2f} GiB{held} of "
                f"{self.budget_bytes / GIB:.2f} GiB ({len(self.probes)} probes, "
                f"~{self.bytes_per_pixel:.0f} B/pixel)")


def _line(a: StepMeasure, b: StepMeasure) -> tuple[float, float]:
    """``(base, c)`` of ``peak = base + c * side^2`` through two measurements."""
    da = a.side**2 - b.side**2
    c = (a.peak_bytes - b.peak_bytes) / da if da else float("nan")
    return a.peak_bytes - c * a.side**2, c


def _predict(base: float, c: float, budget: float) -> float:
    if not c > 0 or budget <= base:
        return float("nan")
    return math.sqrt((budget - base) / c)


def _next_side(fp: Footprint, lo: StepMeasure, hi: StepMeasure | None, guess: float,
               align: int, cap: int) -> int:
    """A legal side strictly inside the bracket, near ``guess`` (doubling without a top)."""
    top = hi.side - align if hi is not None else cap
    if math.isnan(guess):
        guess = (lo.side + hi.side) / 2 if hi is not None else 2 * lo.side
    if hi is None:
        guess = min(max(guess, 1.25 * lo.side), 8 * lo.side)  # grow, but not blindly
    else:  # stay inside, away from the edges, so every probe shrinks the bracket
        guess = min(max(guess, lo.side + 0.15 * (hi.side - lo.side)),
                    hi.side - 0.15 * (hi.side - lo.side))
    side = legal_side(fp, int(min(guess, top)))
    return max(side, lo.side + align) if lo.side + align <= top else lo.side


def find_largest_tile(model: nn.Module, budget_bytes: int, spec: StepSpec | None = None, *,
                      device: str | torch.device = "cpu", max_side: int = 32768,
                      rel_tol: float = 0.05, max_probes: int = 10, margin: float = 0.02,
                      host_rss: int | None = None, measure: Measure | None = None,
                      ) -> TileSearch:
    """The largest legal square tile whose training step stays within ``budget_bytes``.

    Args:
        model: the plain network (on CPU).
        budget_bytes: memory budget: peak RSS of the training process on CPU, peak
            allocated CUDA memory on a GPU.
        spec: memory mode, batch, precision of the step.
        device: ``"cpu"`` or a CUDA device.
        max_side: no larger side is tried (e.g. the image's, past which E cannot improve).
        rel_tol: stop when the bracket ``[fits, fails]`` is narrower than this fraction.
        max_probes: at most this many measurements.
        margin: a step fits when its peak is below ``(1 - margin) * budget`` (run-to-run
            noise of a few MB must not turn a fit into an overflow).
        host_rss: resident size of the process that will train (CPU): what it holds beyond
            a bare step process (Lightning, data, logs) is taken off the budget.
        measure: ``side -> StepMeasure`` (tests); default :func:`measure_step`.

    Raises:
        ConfigError: the smallest legal tile does not fit the budget.
    """
    with probe_server():  # the CPU probes fork from one server, stopped at the end
        return _search(model, budget_bytes, spec or StepSpec(), device, max_side, rel_tol,
                       max_probes, margin, host_rss, measure)


def _search(model: nn.Module, budget_bytes: int, spec: StepSpec, device: str | torch.device,
            max_side: int, rel_tol: float, max_probes: int, margin: float,
            host_rss: int | None, measure: Measure | None) -> TileSearch:
    fp = footprint(model)
    limit = int(budget_bytes * (1 - margin))
    first = smallest_side(fp)
    probes = [(measure or (lambda s: measure_step(model, s, spec, device=device)))(first)]
    lo = probes[0]
    reserve = max(0, host_rss - lo.base_bytes) if host_rss is not None and lo.base_bytes else 0
    limit -= reserve  # what the training process holds beyond a bare step process
    run = measure or (lambda s: measure_step(model, s, spec, budget_bytes=limit, device=device))
    if not lo.fits or lo.peak_bytes > limit:
        raise ConfigError(
            f"memory.budget_gb={budget_bytes / GIB:.3g} is too small: a training step on the "
            f"smallest legal tile ({first} x {first}, memory={spec.memory.mode}, batch "
            f"{spec.batch}) needs {(lo.peak_bytes + reserve) / GIB:.3g} GiB "
            f"({lo.note or 'measured'}; {reserve / GIB:.3g} GiB of it held by the training "
            f"process itself); raise memory.budget_gb, use memory=checkpoint, or a smaller "
            "model")
    hi: StepMeasure | None = None
    cap = legal_side(fp, max_side)
    # on the smallest tile, which the first probe showed to fit: this forward runs in *this*
    # process, and a larger tile (4x the smallest side of a UResNet) could exhaust the machine
    c0 = activation_bytes_per_pixel(model, spec, first) if measure is None else float("nan")
    while len(probes) < max_probes and lo.side < cap:
        if hi is not None and hi.side - lo.side <= max(fp.align, rel_tol * lo.side):
            break
        done = hi is not None and not math.isnan(hi.seconds)  # a stopped probe's peak is low
        ref = hi if done and hi is not None else _nearest(probes, lo)
        base, c = _line(lo, ref) if ref is not lo else (float(lo.peak_bytes), c0)
        guess = _predict(base, c, limit)
        if hi is not None and probes[-1] is hi and not guess < (lo.side + hi.side) / 2:
            # the line just overshot (two close, noisy small-tile peaks can halve its slope):
            # bisect instead of creeping down from the failed side
            guess = (lo.side + hi.side) / 2
        side = _next_side(fp, lo, hi, guess, fp.align, cap)
        if side <= lo.side:
            break
        m = run(side)
        probes.append(m)
        if m.fits and m.peak_bytes <= limit:
            lo = m
        else:
            hi = m
    fitted = [p for p in probes if p.fits and p.side > first]
    bpp = _line(lo, probes[0])[1] if fitted else float("nan")
    search = TileSearch(lo.side, lo.peak_bytes, budget_bytes, probes, bpp, reserve)
    log.info("%s (memory=%s)", search.summary(), spec.memory.mode)
    return search


def activation_bytes_per_pixel(model: nn.Module, spec: StepSpec, side: int = 0) -> float:
    """First guess of ``c``: bytes autograd saves per input pixel, times 1.6 for the backward.

    Counts the distinct storages the forward pass hands to autograd on a small tile (in this
    process, on CPU; default: the smallest legal tile); the backward pass adds gradients and
    kernel workspaces on top, which the factor 1.6 stands for (measured on the U-Nets on
    CPU). Only a starting point: the search measures.
    """
    fp = footprint(model)
    side = side or smallest_side(fp)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    if not isinstance(model, SegmentationNetwork):
        raise ConfigError(f"the tile-size estimate needs a network of the model contract "
                          f"(bands, classes, footprint); {type(model).__name__} is not one")
    x = torch.randn(spec.batch, model.in_channels, side, side)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
    del y
    return 1.6 * sum(seen.values()) / (side * side)


def _nearest(probes: list[StepMeasure], lo: StepMeasure) -> StepMeasure:
    """Another fitted probe to draw the line with (the smallest one), or ``lo`` itself."""
    others = [p for p in probes if p.fits and p.side != lo.side]
    return min(others, key=lambda p: p.side) if others else lo
