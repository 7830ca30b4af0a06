"""What ``fast=true`` runs on this CPU: the network in float32 and bfloat16, NHWC and NCHW.

    .venv/bin/python experiments/bench_fast_precision.py            # a few minutes on 2 cores
    .venv/bin/python experiments/bench_fast_precision.py --quick    # seconds

Two comparisons, each alternated in one run:

1. ``forward``: the demo's U-Net (4 levels, width 16, same padding) on one 4-band tile in
   float32 and under bfloat16 autocast, each in NHWC and NCHW, after a warm-up, the best of
   ``--repeats``; the ratios are against float32 NHWC. Without native bfloat16 kernels
   (oneDNN's check: AVX-512 BF16 or AMX) bfloat16 is emulated; a variant slower than 10x
   float32 is timed once more only, not ``--repeats`` times.
2. ``predict``: ``predict_scene`` of a scene (a file in, a COG out) with ``fast=true``
   against ``fast=false`` (exact), alternated: the seconds, the precision the fast path
   ran (``with_precision``: bfloat16 where native, float32 where emulated) and the labels
   the two outputs share. One untimed prediction of each first: ``layout=auto`` times the
   layouts once per machine and precision.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import add_harness_args, save

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from helpers.prediction import make_image, make_model, make_run  # noqa: E402

from seg_at_scale.io import read_raster  # noqa: E402
from seg_at_scale.models.loading import load_trained  # noqa: E402
from seg_at_scale.prediction.options import (  # noqa: E402
    PredictOptions,
    native_bf16,
    with_precision,
)
from seg_at_scale.prediction.scene import predict_scene  # noqa: E402

VARIANTS = {"fp32_nhwc": (None, torch.channels_last), "fp32_nchw": (None, torch.contiguous_format),
            "bf16_nhwc": (torch.bfloat16, torch.channels_last),
            "bf16_nchw": (torch.bfloat16, torch.contiguous_format)}


def forward_seconds(net: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype | None,
                    fmt: torch.memory_format) -> float:
    """One forward of ``x`` in ``fmt`` under autocast to ``dtype`` (None: float32)."""
    net.to(memory_format=fmt)
    xi = x.contiguous(memory_format=fmt)
    with torch.inference_mode(), torch.autocast("cpu", dtype=dtype or torch.float32,
                                                enabled=dtype is not None):
        t0 = time.perf_counter()
        net(xi)
        return time.perf_counter() - t0


def forwards(side: int, repeats: int) -> dict[str, Any]:
    net = make_model("same", levels=4, width=16)
    x = torch.randn(1, 4, side, side)
    warm = {k: forward_seconds(net, x, *v) for k, v in VARIANTS.items()}
    best = {k: float("inf") for k in VARIANTS}
    for rep in range(repeats):
        for k, v in VARIANTS.items():
            if rep and warm[k] > 10 * warm["fp32_nhwc"]:
                continue  # emulated: once is enough to show it
            best[k] = min(best[k], forward_seconds(net, x, *v))
    net.to(memory_format=torch.contiguous_format)
    return {"side": side, "seconds": {k: round(v, 4) for k, v in best.items()},
            "over_fp32_nhwc": {k: round(v / best["fp32_nhwc"], 2) for k, v in best.items()}}


def predictions(side: int, repeats: int, tmp: Path) -> dict[str, Any]:
    trained = load_trained(run=make_run(tmp / "run", make_model("same", levels=4, width=16)))
    image = make_image(tmp / "scene.tif", side, side)
    seconds: dict[str, list[float]] = {"fast": [], "exact": []}
    for k in range(-1, repeats):  # -1: untimed, layout=auto's measurement (once per machine)
        for name, fast in (("fast", True), ("exact", False)):
            options = PredictOptions(fast=fast, preview=False, stac=False, progress=False,
                                     overwrite=True)
            t0 = time.perf_counter()
            predict_scene(trained, image, tmp / f"{name}{k}.tif", options)
            if k >= 0:
                seconds[name].append(round(time.perf_counter() - t0, 3))
    ran = with_precision(PredictOptions(fast=True), torch.device("cpu")).autocast
    fast, exact = read_raster(tmp / "fast0.tif")[0], read_raster(tmp / "exact0.tif")[0]
    median = {k: statistics.median(v) for k, v in seconds.items()}
    return {"side": side, "seconds": seconds, "median_s": median,
            "fast_precision": str(ran or torch.float32),
            "exact_over_fast": round(median["exact"] / median["fast"], 3),
            "labels_shared": round(float(np.mean(fast == exact)), 5)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", type=int, default=256, help="the forward's tile side")
    ap.add_argument("--scene", type=int, default=1536, help="the predicted scene's side")
    ap.add_argument("--repeats", type=int, default=3, help="timings of each")
    add_harness_args(ap, "a 64 px tile, a 256^2 scene, one timing each")
    args = ap.parse_args(argv)
    if args.quick:
        args.side, args.scene, args.repeats = 64, 256, 1
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="bench-fast-") as name:
        figures = {"native_bf16": native_bf16(torch.device("cpu")),
                   "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                   "forward": forwards(args.side, args.repeats),
                   "predict": predictions(args.scene, args.repeats, Path(name))}
    save("bench_fast_precision", figures, args.out)


if __name__ == "__main__":
    main()
