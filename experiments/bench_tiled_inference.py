"""Tiled vs untiled prediction of one image: is the halo the only overhead, and is it exact?

    .venv/bin/python experiments/bench_tiled_inference.py            # 4096 x 4096, ~10 min
    .venv/bin/python experiments/bench_tiled_inference.py --quick    # 512 x 512 smoke run

Target (issue): tiled throughput >= 0.9 / E x untiled throughput of the same model in the
same run, i.e. ``ratio * E >= 0.9`` where E = computed input pixels / image pixels, and the
stitched logits equal the untiled ones (``predict_full``: the model run once on the whole,
extended image). The model is an untrained U-Net in eval mode, exact fp32, NCHW; the image
is the embedded synthetic scene (``SceneGenerator``, 4 bands, /255).

Timing: every variant runs once as warm-up (oneDNN builds kernels per input shape, and the
warm-up output is the one checked for exactness), then ``--repeats`` rounds in which all
variants run one after another, so a neighbour's load on the shared cores hits them alike.
Throughput is taken from the best round (least disturbed); the median is saved too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from common import add_harness_args, random_feature_init, save

from seg_at_scale.data.synthetic import SceneGenerator
from seg_at_scale.models import UNet
from seg_at_scale.tiling import Window, make_grid, predict_full, predict_tiled


def synthetic_image(size: int, bands: int, seed: int = 0) -> torch.Tensor:
    """The synthetic scene's top-left ``size x size`` window as ``[1, bands, size, size]``."""
    gen = SceneGenerator(seed=seed, height=size, width=size, bands=bands)
    image, _ = gen.render(Window(0, 0, size, size))
    return torch.from_numpy(image).float().div_(255).unsqueeze(0)


def build_model(args: argparse.Namespace, padding: str) -> UNet:
    torch.manual_seed(0)
    return random_feature_init(UNet(args.bands, args.classes, levels=args.levels,
                                    convs_per_level=2, base_width=args.width,
                                    padding=padding)).eval()


def variants(net: UNet, image: torch.Tensor, args: argparse.Namespace
             ) -> dict[str, tuple[Callable[[], torch.Tensor], dict[str, Any]]]:
    """Name -> (call, tiling facts) for the untiled reference and every tiling."""
    h, w = image.shape[-2:]
    fp = net.footprint()
    out: dict[str, tuple[Callable[[], torch.Tensor], dict[str, Any]]] = {
        "untiled": (lambda: predict_full(net, image, fp), {"efficiency": 1.0, "tiles": 1})}
    specs = [("tile_size", t) for t in args.tile_sizes] + [("q", q) for q in args.q]
    for key, value in specs:
        grid = make_grid(h, w, fp, **{key: value})
        facts = {key: value, "grid": list(grid.shape), "tiles": len(grid),
                 "efficiency": grid.efficiency}
        out[f"{key}={value}"] = (
            lambda key=key, value=value: predict_tiled(net, image, fp=fp, **{key: value}),
            facts)
    return out


def timed(call: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    y = call()
    return time.perf_counter() - t0, y


def bench_model(net: UNet, image: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up + check exactness, then time all variants round-robin."""
    runs = variants(net, image, args)
    mpix = image.shape[-2] * image.shape[-1] / 1e6
    rows: dict[str, dict[str, Any]] = {}
    ref: torch.Tensor | None = None
    for name, (call, facts) in runs.items():  # warm-up; the first one is the reference
        dt, y = timed(call)
        row = {**facts, "warmup_s": dt}
        if ref is None:
            ref, ref_labels = y, y.argmax(1)
        else:
            row["max_abs_logit_diff"] = (y - ref).abs().max().item()
            row["bit_identical"] = bool(torch.equal(y, ref))
            row["labels_identical_fraction"] = (y.argmax(1) == ref_labels).double().mean().item()
        rows[name] = row
        del y
        print(f"  warm-up {name}: {dt:.2f} s", flush=True)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.repeats):
        for name, (call, _) in runs.items():
            dt, y = timed(call)
            del y
            times[name].append(dt)
        print(f"  round {r + 1}: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items()),
              flush=True)
    base = mpix / min(times["untiled"])
    for name, row in rows.items():
        row["times_s"] = times[name]
        row["mpix_per_s"] = mpix / min(times[name])
        row["mpix_per_s_median"] = mpix / statistics.median(times[name])
        if name != "untiled":
            row["ratio_to_untiled"] = row["mpix_per_s"] / base
            row["ratio_to_untiled_median"] = (row["mpix_per_s_median"]
                                              / rows["untiled"]["mpix_per_s_median"])
            row["ratio_times_E"] = row["ratio_to_untiled"] * row["efficiency"]
            row["pass_ratio_times_E_ge_0.9"] = row["ratio_times_E"] >= 0.9
    fp = net.footprint()
    return {"footprint": {"halo": fp.halo, "context": fp.context, "align": fp.align,
                          "padding": fp.padding}, "variants": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096, help="image side in pixels")
    p.add_argument("--bands", type=int, default=4)
    p.add_argument("--classes", type=int, default=5)
    p.add_argument("--levels", type=int, default=4)
    p.add_argument("--width", type=int, default=16, help="U-Net base width")
    p.add_argument("--tile-sizes", type=int, nargs="*", default=[1024, 2048])
    p.add_argument("--q", type=int, nargs="*", default=[2, 4])
    p.add_argument("--repeats", type=int, default=2, help="timed rounds after the warm-up")
    p.add_argument("--paddings", nargs="+", default=["same", "valid"],
                   choices=["same", "valid"])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--name", default="bench_tiled_inference", help="the result's benchmark name")
    add_harness_args(p, "384 x 384, U-Net levels 3 width 8, tile 192, q 2, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.tile_sizes, args.q, args.repeats = 384, [192], [2], 1
        args.levels, args.width = 3, 8
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    image = synthetic_image(args.size, args.bands)
    results: dict[str, Any] = {}
    for padding in args.paddings:
        net = build_model(args, padding)
        print(f"{padding}-padding U-Net, {args.size}^2, footprint {net.footprint()}", flush=True)
        results[padding] = bench_model(net, image, args)
    tiled = [row for r in results.values() for n, row in r["variants"].items() if n != "untiled"]
    save(args.name, {
        "what": "tiled (predict_tiled) vs untiled (predict_full) prediction, same model, "
                "same image, same run",
        "target": "ratio_to_untiled * E >= 0.9 (halo is the only overhead); logits equal",
        "method": "exact fp32, NCHW, eval, untrained U-Net (random_feature_init); one "
                  "warm-up per variant, then "
                  f"{args.repeats} round-robin rounds; mpix_per_s from the best round "
                  "(median also given); ratios are within one run because other jobs may "
                  "share the 2 cores",
        "threads": args.threads, "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "image": {"size": args.size, "bands": args.bands, "source": "SceneGenerator(seed=0)/255"},
        "model": {"levels": args.levels, "width": args.width, "convs_per_level": 2,
                  "classes": args.classes},
        "results": results,
        "summary": {
            "all_pass_ratio_times_E": all(r["pass_ratio_times_E_ge_0.9"] for r in tiled),
            "min_ratio_times_E": min(r["ratio_times_E"] for r in tiled),
            "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in tiled),
            "min_labels_identical_fraction": min(r["labels_identical_fraction"] for r in tiled),
            "all_bit_identical": all(r["bit_identical"] for r in tiled),
        },
    }, args.out)


if __name__ == "__main__":
    main()
