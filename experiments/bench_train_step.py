"""Exact whole-image training step, tiled vs untiled: peak memory, time, equal gradients.

    .venv/bin/python experiments/bench_train_step.py            # 2048 x 2048 + scaling, ~30 min
    .venv/bin/python experiments/bench_train_step.py --quick    # 512 x 512 smoke run

Targets (issue): on a 2048 x 2048 image, tiled (q = 4 and 8) vs untiled, peak memory ratio
<= 0.3, time ratio <= 1.4, gradients equal; and the largest square image one exact
training step handles within 16 GB (checked as 16 GiB), untiled vs tiled.

Model: small same-padding U-Net (levels 4, base width 16, 4 bands, 5 classes, fp32, seeded,
no norm, so tiling is exact); loss: ``CrossEntropy`` on the synthetic scene's mask; one
step = forward + backward of the whole-image mean loss (no optimizer update). Untiled is
``loss(net(image))``; tiled is ``tiled_backward`` (docs/design.md, "Exact training").
Each variant runs in a fresh process (``common.run_isolated``): peak RSS is the process's
own, and it returns its flattened gradient, which the parent compares with the untiled
fp32 one and with a float64 step (max |difference| over max |gradient|, worst per-tensor
relative L2 difference): at millions of pixels fp32 summation error dominates, and it is
larger untiled than tiled.
A float64 tiled-vs-untiled check at ``--exact-side`` shows that the tiling itself is exact
(~1e-16), so the float64 reference at ``--side`` is computed tiled (``--f64-q``): float64
convolutions are slow and an untiled one would need ~10 GB.

Timing: per variant one warm-up step (oneDNN builds kernels per shape), then
``--repeats`` timed steps, best kept; memory is the process peak over all of them.

Memory scaling: untiled peak RSS at a few sides, fitted as ``a + b * pixels`` and solved for
16 GiB; tiled (fixed ``--scale-tile``) at growing sides to show that only the image and
target held in RAM grow (a windowed reader, as prediction uses, would remove even those).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Any

import numpy as np
import psutil
import torch
from common import RESULTS, add_harness_args, peak_rss_self_mib, run_isolated, save

from seg_at_scale.data.synthetic import SceneGenerator
from seg_at_scale.models import UNet
from seg_at_scale.tasks.losses import CrossEntropy
from seg_at_scale.tiling import Window, make_grid, tiled_backward

LIMIT_MIB = 16 * 1024
TILED_NOTE = (
    "tiled step memory = one tile's activations (constant in the image size) + what grows "
    "with the image: the float32 image and uint8 target held in RAM (17 B/px) and the "
    "full-image pixel-weight pass of tiled_backward (~18 B/px transient); the fit's b is "
    "larger than that, so something else grows too (see the report). Streaming tiles from "
    "disk with RasterReader would leave only the tile: then disk bounds the size")
CLASSES = 5


def small_model() -> UNet:
    torch.manual_seed(0)
    return UNet(4, CLASSES, levels=4, convs_per_level=2, base_width=16, padding="same")


def scene(side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Image ``[1, 4, side, side]`` float32 in [0, 1] and target ``[1, side, side]`` uint8."""
    image, mask = SceneGenerator(0, side, side).render(Window(0, 0, side, side))
    x = torch.from_numpy(image).float().div_(255).unsqueeze(0)
    del image
    return x, torch.from_numpy(mask).unsqueeze(0)


def step(net: UNet, loss: CrossEntropy, x: torch.Tensor, y: torch.Tensor,
         tiling: dict[str, int]) -> float:
    """One exact whole-image forward + backward into ``.grad``; returns the loss."""
    net.zero_grad(set_to_none=True)
    if not tiling:
        s, w = loss(net(x), y)
        value = s / w
        value.backward()
        return value.item()
    return float(tiled_backward(net, x, y, loss, **tiling))  # type: ignore[arg-type]


def step_child(side: int, tiling: dict[str, int], repeats: int, with_grad: bool,
               dtype: str = "float32") -> dict[str, Any]:
    """Warm-up + timed steps in this (fresh) process; peak RSS, times, gradient."""
    dt = getattr(torch, dtype)
    net, loss = small_model().to(dt), CrossEntropy(CLASSES)
    x, y = scene(side)
    x = x.to(dt)
    rss_data = psutil.Process().memory_info().rss / 2**20
    times, value = [], 0.0
    for _ in range(repeats + 1 if repeats else 1):  # first = warm-up unless repeats == 0
        t0 = time.perf_counter()
        value = step(net, loss, x, y, tiling)
        times.append(time.perf_counter() - t0)
    grad = (torch.cat([p.grad.flatten() for p in net.parameters()]).double().numpy()
            if with_grad else None)
    return {"loss": value, "step_s": min(times[1:] or times), "first_step_s": times[0],
            "rss_with_data_mib": rss_data, "child_peak_rss_mib": peak_rss_self_mib(),
            "grad": grad}


def run(side: int, tiling: dict[str, int], repeats: int, with_grad: bool = False,
        dtype: str = "float32") -> dict[str, Any]:
    name = "untiled" if not tiling else ",".join(f"{k}={v}" for k, v in tiling.items())
    name += "" if dtype == "float32" else f" {dtype}"
    res = run_isolated(step_child, side, tiling, repeats, with_grad, dtype)
    if res["status"] != "ok":
        print(f"  {side} {name}: FAILED {res['result']}", flush=True)
        return {"side": side, "tiling": name, "error": res["result"]}
    r = res["result"]
    peak = max(res["peak_rss_mib"], r.pop("child_peak_rss_mib"))
    out = {"side": side, "tiling": name, "peak_rss_mib": round(peak, 1),
           "rss_with_data_mib": round(r["rss_with_data_mib"], 1),
           "step_increment_mib": round(peak - r["rss_with_data_mib"], 1),
           "step_s": round(r["step_s"], 2), "first_step_s": round(r["first_step_s"], 2),
           "loss": r["loss"], "grad": r["grad"]}
    if tiling:
        grid = make_grid(side, side, small_model().footprint(), **tiling)  # type: ignore[arg-type]
        out.update(tiles=len(grid), efficiency=round(grid.efficiency, 4))
    print(f"  {side} {name}: peak {peak:.0f} MiB (data {r['rss_with_data_mib']:.0f}), "
          f"step {r['step_s']:.2f} s, loss {r['loss']:.6f}", flush=True)
    return out


def grad_diff(g: np.ndarray, ref: np.ndarray, net: UNet) -> dict[str, float]:
    """Max abs difference relative to max |ref|, and worst per-tensor relative L2."""
    worst, k = 0.0, 0
    for p in net.parameters():
        a, b = g[k:k + p.numel()], ref[k:k + p.numel()]
        worst = max(worst, float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)))
        k += p.numel()
    return {"max_abs_over_max_ref": float(np.abs(g - ref).max() / np.abs(ref).max()),
            "worst_tensor_rel_l2": worst}


def exactness_f64(side: int, qs: list[int]) -> dict[str, Any]:
    """Tiled vs untiled in float64 at a small side: tiling itself adds no error."""
    ref = run(side, {}, 0, with_grad=True, dtype="float64")
    net, out = small_model(), {"side": side}
    for q in qs:
        out[f"q={q}"] = grad_diff(run(side, {"q": q}, 0, True, "float64")["grad"], ref["grad"],
                                  net)
    return out


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Untiled vs tiled q = 4, 8 at ``--side``: ratios and gradient agreement.

    The gradients are compared with the untiled fp32 one *and* with an untiled float64
    step: summing millions of pixels in fp32 (e.g. the head bias gradient, a mean of
    ``softmax - onehot``) is itself inexact, and more so untiled (one long sum) than tiled.
    Tiling passes when it is as close to float64 as untiled fp32 is. The float64 reference
    is itself tiled (``--f64-q``): :func:`exactness_f64` shows tiled = untiled in float64.
    """
    print(f"compare at {args.side} x {args.side}")
    ref = run(args.side, {}, args.repeats, with_grad=True)
    if "error" in ref:
        raise RuntimeError(f"untiled step at {args.side} failed: {ref['error']}")
    net, out = small_model(), {"untiled": ref}
    # float64 reference, tiled: as exact as untiled in float64 (see exactness_float64) at a
    # fraction of the memory (float64 convolutions are slow and twice as large)
    f64 = run(args.side, {"q": args.f64_q}, 0, with_grad=True, dtype="float64")
    if "error" in f64:
        raise RuntimeError(f"float64 reference step at {args.side} failed: {f64['error']}")
    ref["grad_diff_vs_float64"] = grad_diff(ref["grad"], f64["grad"], net)
    out["float64_reference"] = {k: f64[k] for k in ("tiling", "peak_rss_mib", "step_s", "loss")}
    for q in args.q:
        r = run(args.side, {"q": q}, args.repeats, with_grad=True)
        r["memory_ratio"] = round(r["peak_rss_mib"] / ref["peak_rss_mib"], 3)
        r["increment_ratio"] = round(r["step_increment_mib"] / ref["step_increment_mib"], 3)
        r["time_ratio"] = round(r["step_s"] / ref["step_s"], 3)
        r["grad_diff_vs_untiled_fp32"] = grad_diff(r["grad"], ref["grad"], net)
        r["grad_diff_vs_float64"] = grad_diff(r.pop("grad"), f64["grad"], net)
        r["loss_rel_diff"] = abs(r["loss"] - ref["loss"]) / abs(ref["loss"])
        err, err_ref = (d["max_abs_over_max_ref"] for d in (r["grad_diff_vs_float64"],
                                                           ref["grad_diff_vs_float64"]))
        r["pass"] = {"memory_ratio<=0.3": r["memory_ratio"] <= 0.3,
                     "time_ratio<=1.4": r["time_ratio"] <= 1.4,
                     "grads_equal(err_vs_f64<=untiled_fp32_err)": err <= err_ref}
        out[f"q={q}"] = r
    ref.pop("grad")
    return out


def untiled_limit(args: argparse.Namespace, known: dict[str, Any]) -> dict[str, Any]:
    """Untiled peak RSS at several sides; line fit in pixels; side at 16 GiB."""
    print("untiled memory scaling")
    runs = [known if s == known["side"] else run(s, {}, 0) for s in args.untiled_sides]
    runs = [r for r in runs if "error" not in r]
    px = np.array([r["side"] ** 2 for r in runs], float)
    mem = np.array([r["peak_rss_mib"] for r in runs])
    b, a = np.polyfit(px, mem, 1)
    side = side_at_limit(a, b)
    out: dict[str, Any] = {
        "runs": [{k: r[k] for k in ("side", "peak_rss_mib", "step_s")} for r in runs],
        "fit_mib": {"a": round(a, 1), "b_bytes_per_pixel": round(b * 2**20, 1)},
        "side_at_16gib_extrapolated": side}
    avail = psutil.virtual_memory().available / 2**20
    if side is not None and args.confirm and LIMIT_MIB + 2048 < avail:
        s = side // 16 * 16
        print(f"  confirming untiled at {s} (predicted {a + b * s * s:.0f} MiB)")
        r = run(s, {}, 0)
        out["confirm"] = {k: r.get(k) for k in ("side", "peak_rss_mib", "step_s", "error")}
    else:
        out["confirm"] = (f"skipped: --confirm not given, no side to confirm, or {avail:.0f} "
                          f"MiB available < {LIMIT_MIB + 2048} MiB needed")
    return out


def side_at_limit(a: float, b: float) -> int | None:
    """The side whose fitted peak ``a + b * side**2`` (MiB) reaches :data:`LIMIT_MIB`, or
    None where the peak did not grow with the side over the sides measured (a tiled run's
    peak is flat by design; the quick run's small sides give noise) or is past the limit
    already: nothing to extrapolate.
    """
    return int(math.sqrt((LIMIT_MIB - a) / b)) if b > 0 and LIMIT_MIB > a else None


def tiled_limit(args: argparse.Namespace) -> dict[str, Any]:
    """Tiled peak RSS at growing sides with a fixed tile size; what still grows and why."""
    print(f"tiled memory scaling (tile_size {args.scale_tile})")
    runs = [run(s, {"tile_size": args.scale_tile}, 0) for s in args.tiled_sides]
    runs = [r for r in runs if "error" not in r]
    px = np.array([r["side"] ** 2 for r in runs], float)
    mem = np.array([r["peak_rss_mib"] for r in runs])
    b, a = np.polyfit(px, mem, 1)
    # held per pixel: image float32 x 4 bands + target uint8 (+ the loss's weight pass)
    held = 4 * 4 + 1
    return {
        "runs": [{k: r[k] for k in ("side", "peak_rss_mib", "rss_with_data_mib",
                                    "step_increment_mib", "step_s", "tiles", "efficiency")}
                 for r in runs],
        "fit_mib": {"a": round(a, 1), "b_bytes_per_pixel": round(b * 2**20, 1)},
        "side_at_16gib_extrapolated": side_at_limit(a, b),
        "held_bytes_per_pixel_expected": held,
        "side_at_16gib_if_image_uint8_in_ram": int(math.sqrt((LIMIT_MIB - a) * 2**20 / 5)),
        "note": TILED_NOTE,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", type=int, default=2048, help="image side of the comparison")
    p.add_argument("--q", type=int, nargs="+", default=[4, 8])
    p.add_argument("--repeats", type=int, default=1, help="timed steps after the warm-up")
    p.add_argument("--untiled-sides", type=int, nargs="+", default=[1024, 1536, 2048, 2560])
    p.add_argument("--tiled-sides", type=int, nargs="+", default=[2048, 4096, 8192],
                   help="sides of the tiled scaling runs (each >= 2x --scale-tile)")
    p.add_argument("--scale-tile", type=int, default=1024, help="tile_size of the scaling runs")
    p.add_argument("--confirm", action="store_true",
                   help="run untiled at the extrapolated 16 GiB side (needs ~18 GiB free)")
    p.add_argument("--f64-q", type=int, default=4, help="q of the float64 reference step")
    p.add_argument("--exact-side", type=int, default=512,
                   help="side of the float64 tiled-vs-untiled exactness check")
    p.add_argument("--skip-scaling", action="store_true",
                   help="carry the memory-scaling sections over from the saved results")
    add_harness_args(p, "256 px comparison at q 2, scaling runs up to 384 px")
    args = p.parse_args(argv)
    if args.quick:
        args.side, args.q, args.untiled_sides = 256, [2], [128, 192, 256]
        args.tiled_sides, args.scale_tile, args.exact_side, args.f64_q = [256, 384], 256, 64, 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load0 = os.getloadavg()
    cmp = compare(args)
    exact = exactness_f64(args.exact_side, args.q)
    name = "bench_train_step"
    if args.skip_scaling:
        old = json.loads((RESULTS / f"{name}.json").read_text())
        note = f"carried over from the run of {old['date']} (--skip-scaling)"
        scaling = {k: {**old[k], "carried": note} for k in ("untiled_limit", "tiled_limit")}
        scaling["tiled_limit"]["note"] = TILED_NOTE
    else:
        scaling = {"untiled_limit": untiled_limit(args, cmp["untiled"]),
                   "tiled_limit": tiled_limit(args)}
    figures = {
        "model": "UNet(4 bands, 5 classes, levels=4, convs_per_level=2, base_width=16, same), "
                 "fp32, CrossEntropy",
        "footprint": str(small_model().footprint()),
        "side": args.side, "compare": cmp, "exactness_float64": exact, **scaling,
        "load_avg_start_end": [load0, os.getloadavg()],
    }
    save(name, figures, args.out)


if __name__ == "__main__":
    main()
