"""Training sections of ``bench_gpu.py``: exact whole-image steps, the largest tile per
memory mode, offload's cost, and the IBM Gated-SCNN case.

Every figure is measured on one device in one run, against a peer measured alongside
(untiled vs tiled, a memory mode vs ``none``), so the ratios carry the meaning.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from gpu_common import MIB, Peak, Sizes, attempt, fresh, step_figures, sync, unet_from_conf
from torch import nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.memory import GIB, MemoryConfig, StepSpec, apply_memory_mode, find_largest_tile
from seg_at_scale.memory.probe import StepMeasure, measure_step
from seg_at_scale.models import GSCNN
from seg_at_scale.tasks.losses import CrossEntropy
from seg_at_scale.tiling import extend, make_grid, tiled_backward

CLASSES = 5


def train_step(dev: torch.device, sz: Sizes) -> dict[str, Any]:
    """Exact whole-image step (U-Net ``train_model``, fp32), untiled vs tiled at ``train_tile``."""
    base = unet_from_conf(sz.train_model)
    net = fresh(base, dev)
    fp = base.footprint()
    out: dict[str, Any] = {"model": sz.train_model, "tile": sz.train_tile}
    for side in sz.train_sides:
        row: dict[str, Any] = {"E": round(make_grid(side, side, fp,
                                                    tile_size=sz.train_tile).efficiency, 4)}
        for name, step in _whole_image_steps(net, fp, side, sz.train_tile, dev).items():
            row[name] = step_figures(step, dev, sz.repeats)
            row[name]["mpix_per_s"] = _mpix_per_s(side, row[name])
        u, t = row["untiled"], row["tiled"]
        if u.get("fits") and t.get("fits"):
            row["memory_ratio"] = round(t["peak_mib"] / max(u["peak_mib"], 1e-9), 4)
            row["time_ratio"] = round(t["step_s"] / u["step_s"], 4)
        out[str(side)] = row
    out["goals"] = {"memory_ratio": "<= 0.3", "time_ratio": "<= 1.4"}
    return out


def _whole_image_steps(net: nn.Module, fp: Any, side: int, tile: int, dev: torch.device
                       ) -> dict[str, Callable[[], None]]:
    """The exact whole-image gradient of a random ``side``^2 scene, untiled and tiled."""
    g = torch.Generator().manual_seed(side)
    image = torch.randn(1, 4, side, side, generator=g).to(dev)
    target = torch.randint(0, CLASSES, (1, side, side), generator=g).to(dev)
    loss = CrossEntropy(CLASSES).to(dev)

    def untiled() -> None:
        net.zero_grad(set_to_none=True)
        s, w = loss(net(extend(image, fp))[..., :side, :side], target)
        (s / w).backward()

    def tiled() -> None:
        net.zero_grad(set_to_none=True)
        tiled_backward(net, image, target, loss, tile_size=tile, fp=fp)

    return {"untiled": untiled, "tiled": tiled}


def _mpix_per_s(side: int, fig: dict[str, Any]) -> float | None:
    return round(side * side / 1e6 / fig["step_s"], 4) if fig.get("fits") else None


def mode_spec(label: str) -> StepSpec:
    """``mode[:granularity][@precision]`` (``checkpoint:strips@bf16-mixed``) as a step spec."""
    mode, _, prec = label.partition("@")
    mode, _, gran = mode.partition(":")
    return StepSpec(MemoryConfig(mode, granularity=gran or "level"),
                    precision=prec or "32-true", channels_last=True)


def _measure_here(model: nn.Module, spec: StepSpec, dev: torch.device
                  ) -> Callable[[int], StepMeasure]:
    """In-process step measurement (CPU smoke runs: no process spawned per probe)."""
    def measure(side: int) -> StepMeasure:
        net = apply_memory_mode(fresh(model, dev), spec.memory).train()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-6)
        x = torch.randn(spec.batch, 4, side, side, device=dev)
        t = torch.randint(0, CLASSES, (spec.batch, side, side), device=dev)

        def step() -> None:
            with torch.autocast(dev.type, torch.bfloat16, enabled="bf16" in spec.precision):
                y = net(x.contiguous(memory_format=torch.channels_last))
            nn.functional.cross_entropy(y.float(), t).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        f = step_figures(step, dev, repeats=1)
        if not f.get("fits"):
            return StepMeasure(side, 0, 0, math.nan, False, f.get("note") or f.get("error", ""))
        return StepMeasure(side, int(f["peak_mib"] * MIB), 0, f["step_s"], True)
    return measure


def largest_tile(dev: torch.device, sz: Sizes) -> dict[str, Any]:
    """Largest trainable tile per memory mode within the budget; time per pixel vs none."""
    model = unet_from_conf("small")
    budget = sz.budget_gib or 0.9 * torch.cuda.get_device_properties(dev).total_memory / GIB
    out: dict[str, Any] = {"model": "small", "budget_gib": round(budget, 3), "modes": {}}
    for label in sz.tile_modes:
        out["modes"][label] = attempt(lambda label=label: _largest_for(model, label, budget,
                                                                      dev, sz))
    ref = out["modes"].get("none", {})
    for f in out["modes"].values():
        if "side" in f and "side" in ref:
            f["side_vs_none"] = round(f["side"] / ref["side"], 3)
            f["time_vs_none"] = round(f["s_per_mpix"] / ref["s_per_mpix"], 3)
    out["goals"] = {"checkpoint:strips side_vs_none": ">= 2", "time_vs_none": "<= 1.35"}
    return out


def _largest_for(model: nn.Module, label: str, budget_gib: float, dev: torch.device,
                 sz: Sizes) -> dict[str, Any]:
    """One mode's largest tile (``find_largest_tile``) and a timed step there."""
    spec = mode_spec(label)
    here = None if dev.type == "cuda" else _measure_here(model, spec, dev)
    t0 = time.perf_counter()
    s = find_largest_tile(model, int(budget_gib * GIB), spec, device=dev, measure=here,
                          rel_tol=sz.rel_tol, max_probes=sz.max_probes, max_side=sz.max_side)
    timing = StepSpec(spec.memory, precision=spec.precision, channels_last=True, repeats=1)
    again = here(s.side) if here else measure_step(model, s.side, timing, device=dev)
    print(f"   {label}: {s.side}^2, {again.seconds_per_mpix:.3f} s/Mpix", flush=True)
    return {"side": s.side, "peak_mib": round(s.peak_bytes / MIB, 1),
            "bytes_per_pixel": None if math.isnan(s.bytes_per_pixel) else round(
                s.bytes_per_pixel, 1),
            "s_per_mpix": round(again.seconds_per_mpix, 4),
            "probes": [(p.side, round(p.peak_bytes / MIB), p.fits) for p in s.probes],
            "search_s": round(time.perf_counter() - t0, 1)}


def offload_cost(dev: torch.device, sz: Sizes) -> dict[str, Any]:
    """offload vs none (and checkpoint_offload vs checkpoint) at one tile; host link speed."""
    model = unet_from_conf("small")
    side = sz.offload_side
    out: dict[str, Any] = {"model": "small", "side": side, "link_gb_per_s": _link_speed(dev),
                           "modes": {}}
    for label in ("none", "offload", "checkpoint", "checkpoint_offload"):
        net = apply_memory_mode(fresh(model, dev), mode_spec(label).memory).train()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-6)
        step = _fixed_batch_step(net, opt, 1, side, CLASSES, dev)
        out["modes"][label] = step_figures(step, dev, sz.repeats)
        del net, opt, step  # before the next mode's model
    m = out["modes"]
    for mode, ref in (("offload", "none"), ("checkpoint_offload", "checkpoint")):
        if m[mode].get("fits") and m[ref].get("fits"):
            m[mode]["time_vs_" + ref] = round(m[mode]["step_s"] / m[ref]["step_s"], 3)
            m[mode]["memory_vs_" + ref] = round(m[mode]["peak_mib"] / max(m[ref]["peak_mib"],
                                                                           1e-9), 3)
    out["goals"] = {"offload time_vs_none": "< 1.30 (IBM: 1.30 NVLink, 2.06 PCIe)"}
    if dev.type == "cpu":
        out["note"] = "CPU: offload moves nothing (saved tensors already live in host memory)"
    return out


def _fixed_batch_step(net: nn.Module, opt: torch.optim.Optimizer, batch: int, side: int,
                      classes: int, dev: torch.device) -> Callable[[], None]:
    """A training step on a fixed random batch: forward, cross-entropy, backward, update."""
    x = torch.randn(batch, 4, side, side, device=dev)
    t = torch.randint(0, classes, (batch, side, side), device=dev)

    def step() -> None:
        nn.functional.cross_entropy(net(x), t).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _link_speed(dev: torch.device, mib: int = 1024) -> dict[str, float] | None:
    """Pinned host <-> device copy bandwidth in GB/s (None on a CPU)."""
    if dev.type != "cuda":
        return None
    host = torch.empty(mib * MIB, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty_like(host, device=dev)
    speeds = {}
    for name, (dst, src) in {"host_to_device": (gpu, host), "device_to_host": (host, gpu)}.items():
        dst.copy_(src, non_blocking=True)
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        sync(dev)
        speeds[name] = round(3 * mib * MIB / (time.perf_counter() - t0) / 1e9, 2)
    return speeds


def ibm_gscnn(dev: torch.device, sz: Sizes) -> dict[str, Any]:
    """The IBM LMS case: Gated-SCNN, batch of crops, SGD; peak memory and step per mode."""
    torch.manual_seed(0)
    model = GSCNN.from_preset(sz.gscnn_preset, in_channels=4, num_classes=19).train()
    b, c = sz.gscnn_batch, sz.gscnn_crop
    out: dict[str, Any] = {"preset": sz.gscnn_preset, "crop": c, "batch": b,
                           "parameters_M": round(sum(p.numel() for p in model.parameters())
                                                 / 1e6, 2), "modes": {}}
    for label in ("none", "checkpoint:block", "offload", "checkpoint_offload:block"):
        try:
            net = apply_memory_mode(fresh(model, dev), mode_spec(label).memory).train()
        except ConfigError as e:  # a mode this model cannot run: the reason is the figure
            out["modes"][label] = {"refused": str(e)}
            continue
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        with Peak(dev) as whole:  # includes the optimiser state made by the first step
            step = _fixed_batch_step(net, opt, b, c, 19, dev)
            out["modes"][label] = step_figures(step, dev, max(1, sz.repeats // 2))
        out["modes"][label]["peak_mib_with_state"] = whole.mib
        del net, opt, step  # before the next mode's model
    out["note"] = ("loss: cross-entropy only (the task's boundary terms left out); BatchNorm "
                   "in train mode; SGD momentum 0.9, as in the recipe")
    return out
