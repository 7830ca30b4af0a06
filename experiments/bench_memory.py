"""Largest trainable tile per memory mode within a budget, and what each mode costs in time.

Run it::

    python experiments/bench_memory.py                        # small + medium U-Net, 6 GiB
    python experiments/bench_memory.py --quick --out /tmp/r.json  # smoke run, seconds
    python experiments/bench_memory.py --models uresnet_cosmic --name bench_memory_uresnet
    python experiments/bench_memory.py --models smp:Unet:resnet34 --modes none,checkpoint,\
        checkpoint:block --no-search --time-side 1024 --name bench_memory_smp

For each U-Net size (or ``uresnet_<preset>``: residual levels, deeper per resolution; its
tile is per wire plane, all three planes in one step; or ``smp:<arch>:<encoder>``: an smp
network, 4 bands, 5 classes, checkpointed by stage or building block) and memory mode, on
this machine's CPU:

* the largest legal square tile whose training step (forward, loss, backward, AdamW step;
  fresh process, peak RSS) fits ``--budget-gb`` (:func:`seg_at_scale.memory.find_largest_tile`);
* step time per input megapixel, at one common side for every mode (``--time-side``, best
  of ``--rounds`` interleaved rounds), and
  at each mode's own largest tile, relative to ``none`` measured in the same run;
* ``mode[:granularity][@precision]`` rows (``checkpoint:strips``, ``none@bf16-mixed``) pick a
  checkpoint granularity and autocast; bf16 rows are also compared with ``none`` in bf16;
* the halo overhead E on a ``--image`` x ``--image`` scene at the auto-chosen tile vs the
  default tile (512, ``conf/tiling``), and the whole-image training throughput that follows
  (output Mpix/s = 1 / (E x seconds per input Mpix); also per CPU-second, which a loaded
  machine disturbs less than wall time).

On a CPU, ``offload`` moves nothing (saved tensors already live in host memory): the wrapper
runs the ``none`` code path there, and ``checkpoint_offload`` the ``checkpoint`` one; the
script says so in the JSON instead of spending minutes measuring the same code twice.
Saves ``experiments/results/<name>.json`` with the machine and the load average.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import torch
from common import add_harness_args, save

from seg_at_scale.memory import (
    GIB,
    MemoryConfig,
    StepMeasure,
    StepSpec,
    find_largest_tile,
    measure_step,
)
from seg_at_scale.models import UNET_SIZES, URESNET_SIZES, UNet, UResNet
from seg_at_scale.models.smp import SMPModel
from seg_at_scale.tiling import make_grid
from seg_at_scale.tiling.tile_sides import legal_side

DEFAULT_TILE = 512  # conf/tiling/random.yaml tile_size


def build(size: str) -> UNet | UResNet | SMPModel:
    """A U-Net preset (``small``), a UResNet one (``uresnet_cosmic``: 3 planes), or an smp
    network (``smp:Unet:resnet34``)."""
    torch.manual_seed(0)
    if size.startswith("smp:"):
        _, arch, encoder = size.split(":")
        return SMPModel(arch, encoder, in_channels=4, num_classes=5)
    if size.startswith("uresnet_"):
        return UResNet(**URESNET_SIZES[size.removeprefix("uresnet_")].kwargs())
    s = UNET_SIZES[size]
    return UNet(in_channels=4, num_classes=5, levels=s.levels, convs_per_level=s.convs_per_level,
                base_width=s.base_width, padding="same")


def mode_spec(label: str, granularity: str, spec: dict[str, Any], **extra: Any) -> StepSpec:
    """``mode[:granularity][@precision]`` as a step spec (``checkpoint@bf16-mixed``,
    ``checkpoint:strips``); without ``:granularity`` the ``--granularity`` one."""
    mode, _, precision = label.partition("@")
    mode, _, gran = mode.partition(":")
    strips = {"strip_rows": spec.get("strip_rows", 128), "strip_cols": spec.get("strip_cols")}
    return StepSpec(MemoryConfig(mode, granularity=gran or granularity, **strips),
                    precision=precision or "32-true",
                    **{k: v for k, v in spec.items() if k not in strips}, **extra)


def time_modes(net: UNet, modes: list[str], side: int, spec: dict[str, Any],
               granularity: str, rounds: int) -> dict[str, Any]:
    """Seconds per input Mpix of every mode at one side.

    Fresh process per measurement, two steps each (the second is timed); the modes are
    interleaved over ``rounds`` rounds and the fastest is kept, so a burst of load from
    elsewhere hits one round of every mode rather than all rounds of one.
    """
    out: dict[str, Any] = {}
    for r in range(rounds):
        for mode in modes:
            m = measure_step(net, side, mode_spec(mode, granularity, spec, repeats=1))
            prev = out.setdefault(mode, {"s_per_mpix": math.inf, "cpu_s_per_mpix": math.inf})
            prev["s_per_mpix"] = round(min(prev["s_per_mpix"], m.seconds_per_mpix), 3)
            prev["cpu_s_per_mpix"] = round(min(prev["cpu_s_per_mpix"], m.cpu_seconds_per_mpix), 3)
            prev["peak_mib"] = round(m.peak_bytes / 2**20, 1)
            prev["before_step_mib"] = round(m.base_bytes / 2**20, 1)
            print(f"  round {r}, time at {side}^2, {mode}: {m.seconds_per_mpix:.2f} s/Mpix wall, "
                  f"{m.cpu_seconds_per_mpix:.2f} CPU, peak {m.peak_bytes / 2**20:.0f} MiB",
                  flush=True)
    for v in out.values():
        v["peak_vs_none"] = round(v["peak_mib"] / out["none"]["peak_mib"], 3)
        v["step_peak_vs_none"] = round((v["peak_mib"] - v["before_step_mib"]) / (
            out["none"]["peak_mib"] - out["none"]["before_step_mib"]), 3)
        v["time_vs_none"] = round(v["s_per_mpix"] / out["none"]["s_per_mpix"], 3)
        v["cpu_time_vs_none"] = round(v["cpu_s_per_mpix"] / out["none"]["cpu_s_per_mpix"], 3)
    return out


def search_modes(net: UNet, modes: list[str], args: argparse.Namespace,
                 spec: dict[str, Any]) -> dict[str, Any]:
    """Largest tile per mode; CPU offload modes reuse the mode they run as on a CPU."""
    found: dict[str, Any] = {}
    for mode in modes:
        same_as = {"offload": "none", "checkpoint_offload": "checkpoint"}.get(mode)
        if same_as and same_as in found:
            found[mode] = dict(found[same_as], note=f"CPU: runs the {same_as} code path "
                               "(no device memory to offload)")
            continue
        t0 = time.perf_counter()
        s = find_largest_tile(net, int(args.budget_gb * GIB),
                              mode_spec(mode, args.granularity, spec),
                              max_side=args.max_side, rel_tol=args.rel_tol,
                              max_probes=args.max_probes)
        failed = [p.side for p in s.probes if not p.fits]
        # the probe timed a first step (allocator warm-up included): time a second one
        at = measure_step(net, s.side, mode_spec(mode, args.granularity, spec, repeats=1))
        found[mode] = {"side": s.side, "peak_mib": round(s.peak_bytes / 2**20, 1),
                       "bracket_fail": min((f for f in failed if f > s.side), default=None),
                       "bytes_per_pixel": round(s.bytes_per_pixel, 1),
                       "s_per_mpix_at_side": round(at.seconds_per_mpix, 3),
                       "cpu_s_per_mpix_at_side": round(at.cpu_seconds_per_mpix, 3),
                       "probes": [(p.side, round(p.peak_bytes / 2**20), p.fits) for p in s.probes],
                       "search_s": round(time.perf_counter() - t0, 1)}
        print(f"  {mode}: largest tile {s.side}^2 (peak {s.peak_bytes / 2**20:.0f} MiB, "
              f"{len(s.probes)} probes, {found[mode]['search_s']} s)", flush=True)
    return found


def halo_overhead(net: UNet, found: dict[str, Any], image: int, default: StepMeasure,
                  ) -> dict[str, Any]:
    """E and whole-image throughput at the default tile and at each mode's auto tile."""
    fp = net.footprint()
    side0 = legal_side(fp, DEFAULT_TILE)
    e0 = make_grid(image, image, fp, tile_size=side0).efficiency
    out: dict[str, Any] = {"image": image, "default_tile": side0, "E_default": round(e0, 4),
                           "mpix_per_s_default": round(1 / (e0 * default.seconds_per_mpix), 4),
                           "mpix_per_cpu_s_default": round(
                               1 / (e0 * default.cpu_seconds_per_mpix), 4)}
    for mode, f in found.items():
        e = make_grid(image, image, fp, tile_size=f["side"]).efficiency
        out[mode] = {"tile": f["side"], "E": round(e, 4),
                     "mpix_per_s": round(1 / (e * f["s_per_mpix_at_side"]), 4),
                     "mpix_per_cpu_s": round(1 / (e * f["cpu_s_per_mpix_at_side"]), 4)}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="small,medium")
    p.add_argument("--modes", default="none,checkpoint,checkpoint:strips,offload,"
                   "checkpoint_offload,none@bf16-mixed,checkpoint@bf16-mixed,"
                   "checkpoint:strips@bf16-mixed",
                   help="mode[:granularity][@precision], comma-separated")
    p.add_argument("--granularity", default="level", help="for modes without :granularity")
    p.add_argument("--strip-rows", type=int, default=128, help="for checkpoint:strips")
    p.add_argument("--strip-cols", type=int, default=1024,
                   help="for checkpoint:strips (0: whole rows)")
    p.add_argument("--budget-gb", type=float, default=6.0)
    p.add_argument("--rel-tol", type=float, default=0.08)
    p.add_argument("--max-probes", type=int, default=6)
    p.add_argument("--max-side", type=int, default=16384)
    p.add_argument("--time-side", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds")
    p.add_argument("--image", type=int, default=10000)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-search", dest="search", action="store_false",
                   help="time and measure at --time-side only (no largest-tile search)")
    p.add_argument("--name", default="bench_memory", help="the result's benchmark name")
    add_harness_args(p, "tiny U-Net, none and checkpoint, 1 GiB, sides up to 256, 2 probes")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.modes, args.budget_gb, args.max_side = "tiny", "none,checkpoint", 1, 256
        args.max_probes, args.rel_tol, args.time_side, args.rounds = 2, 0.5, 64, 1
        args.image = 1024
    modes = args.modes.split(",")
    spec = {"channels_last": True, "threads": args.threads, "strip_rows": args.strip_rows,
            "strip_cols": args.strip_cols or None}
    load0, t0 = os.getloadavg(), time.perf_counter()
    results: dict[str, Any] = {}
    for size in args.models.split(","):
        net = build(size)
        print(f"{size} {type(net).__name__}: "
              f"{sum(q.numel() for q in net.parameters()) / 1e6:.2f} M params", flush=True)
        timing = time_modes(net, modes, legal_side(net.footprint(), args.time_side), spec,
                            args.granularity, args.rounds)
        if not args.search:
            results[size] = {"timing_common_side": timing}
            continue
        t_default = measure_step(net, legal_side(net.footprint(), DEFAULT_TILE),
                                 mode_spec("none", "level", spec, repeats=1))
        found = search_modes(net, modes, args, spec)
        for mode, f in found.items():
            # against fp32 none, and (bf16 rows) against none at the same precision
            prec = mode.partition("@")[2]
            refs = {"none": "none"}
            if prec and f"none@{prec}" in found:
                refs[f"none@{prec}"] = "none_same_precision"
            for ref, tag in refs.items():
                f[f"side_vs_{tag}"] = round(f["side"] / found[ref]["side"], 3)
                for k in ("s_per_mpix_at_side", "cpu_s_per_mpix_at_side"):
                    f[k.replace("s_per_mpix", f"time_vs_{tag}")] = round(
                        f[k] / found[ref][k], 3)
        results[size] = {"timing_common_side": timing, "largest_tile": found,
                         "halo_overhead": halo_overhead(net, found, args.image, t_default)}
    save(args.name, {
        "budget_gib": args.budget_gb, "time_side": args.time_side, "rounds": args.rounds,
        "granularity": args.granularity, "strip_rows": args.strip_rows,
        "strip_cols": args.strip_cols or None, "rel_tol": args.rel_tol,
        "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE"),
        "measure": "peak RSS (VmHWM) of a fresh process running one training step; time: "
                   "the second step in a fresh process, at a common side and at each "
                   "mode's largest tile",
        "loadavg_start": list(load0), "loadavg_end": list(os.getloadavg()),
        "wall_s": round(time.perf_counter() - t0, 1), "results": results,
        "goals": {"checkpoint_side_vs_none": ">= 2", "checkpoint_time_vs_none": "<= 1.35",
                  "offload_time_vs_none": "< 1.30"}}, args.out)


if __name__ == "__main__":
    main()
