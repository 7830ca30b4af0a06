"""fairscale Pipe on this CPU: pipeline-1 vs the plain model, planner predicted vs measured.

    .venv/bin/python experiments/bench_pipeline.py              # ~5 min on 2 cores
    .venv/bin/python experiments/bench_pipeline.py --plan-only  # the 6 / 8 GPU plans only

Figures (issue 3):
1. pipeline-1 (one stage, m micro-batches, checkpointing) vs the plain model, same batch,
   forward + backward per step. torchgpipe's U-Net benchmark reports 0.858x for this.
2. The planner's predicted step time vs the measured one for k = 1, 2, 3 stages on CPU
   (all stages share the CPU, so fairscale runs them on one worker thread: the planner
   models that), balance by measured time.
3. Plans for 6 and 8 GPUs of 80 GB for the large pipeline U-Net (``pipe_large``, 303 M
   parameters) on the seed's 1250 x 1250 tiles + halo, from a profile measured here on a
   smaller tile and scaled by pixel count (time and activations scale with pixels, weights
   do not). Memory is fp32 and device-independent; the times are this CPU's, so only
   their ratios carry over to a GPU.

Model for 1-2: same-padding U-Net, 4 levels, base width 16 (the ``small`` preset), 4 bands,
5 classes, on batches of 256 x 256 tiles; timings are medians after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from common import add_harness_args, save

from seg_at_scale.models import UNet
from seg_at_scale.parallel.pipe import PipelineConfig, build_pipe, close_pipe
from seg_at_scale.parallel.planner import GB, balance_by, plan, predict
from seg_at_scale.parallel.profile import LayerCost, profile_layers


def step_time(fn: Any, x: torch.Tensor, repeats: int) -> float:
    """Median seconds of ``fn(x).sum().backward()`` after one warm-up."""
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        fn(x).float().pow(2).mean().backward()
        if r:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def scale_costs(costs: list[LayerCost], factor: float) -> list[LayerCost]:
    """A profile measured on a smaller tile, scaled to ``factor`` times the pixels."""
    return [LayerCost(c.name, c.forward_s * factor, c.backward_s * factor,
                      int(c.saved_bytes * factor), int(c.output_bytes * factor),
                      int(c.stash_bytes * factor), c.param_bytes) for c in costs]


def cpu_figures(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    net = UNet(4, 5, levels=4, convs_per_level=2, base_width=16, padding="same")
    n = len(net.pipeline_layers())
    x = torch.randn(args.batch, 4, args.tile, args.tile)
    plain = step_time(net, x, args.repeats)
    out: dict[str, Any] = {"model": "UNet small (levels 4, width 16, same)", "layers": n,
                           "batch": args.batch, "tile": args.tile, "plain_step_s": plain,
                           "pipeline_1": {}, "planner": {}}
    for chunks, ck in [(1, "never"), (args.chunks, "never"), (args.chunks, "except_last"),
                       (args.chunks, "always")]:
        pipe = build_pipe(net, PipelineConfig([n], ["cpu"], chunks, ck))
        t = step_time(pipe, x, args.repeats)
        close_pipe(pipe)
        out["pipeline_1"][f"m{chunks}_{ck}"] = {"step_s": t, "speed_vs_plain": plain / t}
        print(f"pipeline-1 m={chunks} {ck}: {t:.3f} s vs plain {plain:.3f} s -> "
              f"{plain / t:.3f}x", flush=True)
    micro = torch.randn(args.batch // args.chunks, 4, args.tile, args.tile)
    costs = profile_layers(net.pipeline_layers(), micro, repeats=args.repeats)
    for k in (1, 2, 3):
        bal = balance_by(costs, k, "time")
        pred = predict(costs, bal, ["cpu"] * k, args.chunks, "except_last", args.batch,
                       profiled_batch=args.batch // args.chunks)
        pipe = build_pipe(net, PipelineConfig(bal, ["cpu"] * k, args.chunks, "except_last"))
        meas = step_time(pipe, x, args.repeats)
        close_pipe(pipe)
        out["planner"][f"k{k}"] = {"balance": bal, "predicted_s": pred.step_s,
                                   "measured_s": meas, "ratio": pred.step_s / meas}
        print(f"k={k} balance {bal}: predicted {pred.step_s:.3f} s, measured {meas:.3f} s "
              f"(ratio {pred.step_s / meas:.2f})", flush=True)
    return out


def gpu_plans(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    net = UNet(4, 5, levels=5, convs_per_level=2, base_width=200, padding="same")
    fp = net.footprint()
    side = 1250 + 2 * fp.context
    side = -(-side // fp.align) * fp.align
    probe = args.probe_tile
    costs = profile_layers(net.pipeline_layers(), torch.randn(1, 4, probe, probe), repeats=1)
    costs = scale_costs(costs, (side / probe) ** 2)
    params_gb = sum(c.param_bytes for c in costs) / GB
    plans: dict[str, Any] = {"model": "UNet pipe_large (levels 5, width 200, same)",
                             "parameters_M": sum(p.numel() for p in net.parameters()) / 1e6,
                             "tile_input": side, "profiled_on": probe, "weights_gb": params_gb,
                             "batch": args.plan_batch}
    for gpus in (6, 8):
        p = plan(costs, [f"cuda:{i}" for i in range(gpus)], args.plan_batch,
                 memory_cap_gb=80.0)
        print(f"\n{gpus} GPUs of 80 GB, batch {args.plan_batch} tiles of {side}^2:\n"
              f"{p.table()}", flush=True)
        plans[f"gpus{gpus}"] = p.as_dict()
    one = predict(costs, [len(costs)], ["cuda:0"], 1, "never", args.plan_batch)
    plans["one_gpu_no_pipeline_peak_gb"] = one.peak_bytes / GB
    print(f"without a pipeline one device would need {one.peak_bytes / GB:.0f} GB", flush=True)
    return plans


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--tile", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--probe-tile", type=int, default=256)
    ap.add_argument("--plan-batch", type=int, default=8)
    ap.add_argument("--plan-only", action="store_true")
    add_harness_args(ap, "64 px tiles, batch 4, 2 chunks, one timed step; plans profiled on "
                         "128 px (below that the scaled profile fits no plan)")
    args = ap.parse_args(argv)
    if args.quick:
        args.tile, args.batch, args.chunks, args.repeats, args.probe_tile = 64, 4, 2, 1, 128
    torch.set_num_threads(args.threads)
    figures: dict[str, Any] = {"threads": args.threads}
    if not args.plan_only:
        figures["cpu"] = cpu_figures(args)
    figures["plans"] = gpu_plans(args)
    save("bench_pipeline" + ("_plans" if args.plan_only else ""), figures, args.out)


if __name__ == "__main__":
    main()
