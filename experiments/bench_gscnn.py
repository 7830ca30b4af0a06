"""Gated-SCNN on 800 x 800: memory per image untiled vs tiled, and the two-pass overhead.

    .venv/bin/python experiments/bench_gscnn.py                  # small preset, 800^2, ~5 min
    .venv/bin/python experiments/bench_gscnn.py --size medium --q 2
    .venv/bin/python experiments/bench_gscnn.py --quick          # 400^2 tiny smoke run

Model: ``GSCNN`` preset (``--size``), 4 bands (RGB + Canny), 19 classes, fp32, seeded, eval
mode (BatchNorm with its running statistics, i.e. frozen); input: a synthetic street scene
with its Canny band. Each variant runs in a fresh process (``common.run_isolated``) so that
its peak RSS is its own; ``above_baseline_mib`` is that peak minus the RSS after building
the model and the image (torch, weights, input), i.e. the memory the computation adds:

* ``untiled``: ``predict_full`` (the baseline);
* ``tiled_one_pass q=N``: ``predict_tiled``; each tile's image pooling sees only its own
  window: not exact, the error against untiled is reported;
* ``tiled_two_pass q=N``: ``predict_tiled_two_pass``: pass 1 averages the backbone features
  over the tiles' cores, pass 2 predicts with that mean: exact;
* ``train_untiled`` / ``train_two_pass q=N``: one exact whole-image gradient of the
  segmentation cross-entropy, untiled vs ``tiled_backward_two_pass`` (3 passes);
* ``bn_train_*``: the forward with BatchNorm in train mode (batch statistics), untiled vs
  two-pass tiles run anyway: how far from exact what prediction refuses would be.

Time: one warm-up run, then ``--repeats`` timed runs, best kept. The two-pass overhead is
``time(two-pass) / time(one-pass)`` at the same tiling. The machine is shared: the load
average before and after is recorded; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from common import add_harness_args, run_isolated, save

from seg_at_scale.data.sources.streets import canny_band, render_street
from seg_at_scale.models import GSCNN
from seg_at_scale.tasks.losses import CrossEntropy
from seg_at_scale.tiling import (
    Footprint,
    extend,
    make_grid,
    predict_full,
    predict_tiled,
    predict_tiled_two_pass,
    tiled_backward_two_pass,
)
from seg_at_scale.tiling.predict import run_tile
from seg_at_scale.tiling.statistics import image_pool_mean

CLASSES = 19


def _inputs(side: int, size: str) -> tuple[GSCNN, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = GSCNN.from_preset(size, in_channels=4, num_classes=CLASSES).eval()
    rgb, mask = render_street(side, side, seed=0)
    bands = np.concatenate([rgb, canny_band(rgb)[None]]).astype(np.float32) / 255.0
    image = torch.from_numpy((bands - 0.5) / 0.25)[None]
    return net, image, torch.from_numpy(mask.astype(np.int64))[None]


def _variant(kind: str, q: int, side: int, size: str, repeats: int, out: str,
             fp: Footprint) -> dict[str, Any]:
    """Child process: build, warm up, time ``repeats`` runs; save the output to ``out``.

    ``fp`` comes from the parent: the receptive-field probe would otherwise set the
    child's peak memory.
    """
    net, image, target = _inputs(side, size)
    base = psutil.Process().memory_info().rss / 2**20  # ru_maxrss survives exec: not usable
    loss = CrossEntropy(CLASSES)

    if kind.startswith("bn_train"):  # BatchNorm with batch (= tile) statistics
        net.train()

    def run() -> torch.Tensor:
        if kind == "bn_train_untiled":
            with torch.no_grad():
                return net(extend(image, fp))[..., :side, :side]
        if kind == "bn_train_two_pass":  # what the tiles give: prediction refuses to
            return _tiles_anyway(net, image, q, fp)
        if kind == "untiled":
            return predict_full(net, image, fp)
        if kind == "tiled_one_pass":
            return predict_tiled(net, image, q=q, fp=fp)
        if kind == "tiled_two_pass":
            return predict_tiled_two_pass(net, image, q=q, fp=fp)
        net.zero_grad()
        if kind == "train_untiled":
            s, w = loss(net(extend(image, fp))[..., :side, :side], target)
            (s / w).backward()
        else:
            tiled_backward_two_pass(net, image, target, loss, q=q, fp=fp)
        return torch.cat([p.grad.flatten() for p in net.parameters()])

    times = []
    for _ in range(1 + repeats):
        t0 = time.perf_counter()
        y = run()
        times.append(time.perf_counter() - t0)
    torch.save(y, out)
    grid = make_grid(side, side, fp, q=q)
    return {"kind": kind, "q": q if kind not in ("untiled", "train_untiled") else 1,
            "seconds": round(min(times[1:]), 3), "rss_before_mib": round(base, 1),
            "tiles": len(grid), "efficiency": round(grid.efficiency, 3)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", type=int, default=800)
    ap.add_argument("--size", default="small")
    ap.add_argument("--q", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--name", default="bench_gscnn", help="the result's benchmark name")
    add_harness_args(ap, "200^2, tiny preset, q=2")
    ap.add_argument("--mmap-threshold", type=int, default=None,
                    help="glibc MALLOC_MMAP_THRESHOLD_ for the children (e.g. 131072): big "
                         "buffers go back to the OS when freed, so RSS tracks live memory")
    args = ap.parse_args(argv)
    if args.mmap_threshold:  # read by glibc when each spawned child starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    if args.quick:
        args.side, args.size, args.q = 200, "tiny", [2]
    load_before = os.getloadavg()
    fp = GSCNN.from_preset(args.size, in_channels=4, num_classes=CLASSES).footprint()
    kinds = [("untiled", 1)] + [(k, q) for q in args.q for k in ("tiled_one_pass",
                                                                 "tiled_two_pass")]
    kinds += [("bn_train_untiled", 1), ("bn_train_two_pass", args.q[0])]
    if not args.no_train:
        kinds += [("train_untiled", 1)] + [("train_two_pass", q) for q in args.q]
    rows, outputs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, q in kinds:
            path = str(Path(tmp) / f"{kind}_{q}.pt")
            res = run_isolated(_variant, kind, q, args.side, args.size, args.repeats, path, fp)
            if res["status"] != "ok":
                raise SystemExit(f"{kind} q={q} failed: {res['result']}")
            row = res["result"] | {"peak_rss_mib": round(res["peak_rss_mib"], 1)}
            row["above_baseline_mib"] = round(row["peak_rss_mib"] - row["rss_before_mib"], 1)
            outputs[(kind, q)] = torch.load(path, weights_only=True)
            print(row, flush=True)
            rows.append(row)
    _compare(rows, outputs)
    save(args.name, {
        "model": f"GSCNN preset {args.size}, 4 bands (RGB + Canny), {CLASSES} classes, fp32, "
                 "eval mode (frozen BatchNorm)",
        "image": f"{args.side} x {args.side} synthetic street scene",
        "halo": fp.halo, "context": fp.context, "align": fp.align,
        "malloc_mmap_threshold": args.mmap_threshold,
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
        "rows": rows, "summary": _summary(rows)}, args.out)


@torch.no_grad()
def _tiles_anyway(net: GSCNN, image: torch.Tensor, q: int, fp: Footprint) -> torch.Tensor:
    """The two-pass tiles of a network whose BatchNorm trains, stitched.

    ``predict_tiled`` refuses such a network (each tile normalises with its own
    statistics); here each tile runs anyway, to measure how far that is from the untiled
    train-mode forward.
    """
    grid = make_grid(image.shape[-2], image.shape[-1], fp, q=q)
    out = None
    with net.fixed_image_pool(image_pool_mean(net, image, grid)):
        for tile in grid.tiles:
            y = run_tile(net, image, tile, fp)
            if out is None:
                out = y.new_empty((*y.shape[:2], *image.shape[-2:]))
            rows, cols = tile.core.slices()
            out[..., rows, cols] = y
    assert out is not None
    return out


def _compare(rows: list[dict[str, Any]], outputs: dict[tuple[str, int], torch.Tensor]) -> None:
    ref, gref = outputs[("untiled", 1)], outputs.get(("train_untiled", 1))
    for row in rows:
        y = outputs[(row["kind"], row["q"])]
        if row["kind"] == "bn_train_untiled":  # the reference of the next row
            continue
        if row["kind"] == "bn_train_two_pass":  # against the untiled train-mode forward
            ref_bn = outputs[("bn_train_untiled", 1)]
            row["max_abs_logit_diff"] = float((y - ref_bn).abs().max())
            row["label_agreement"] = float((y.argmax(1) == ref_bn.argmax(1)).float().mean())
            continue
        if row["kind"].startswith("train"):
            assert gref is not None
            row["grad_rel_err"] = float((y - gref).abs().max() / gref.abs().max())
        else:
            row["max_abs_logit_diff"] = float((y - ref).abs().max())
            row["label_agreement"] = float((y.argmax(1) == ref.argmax(1)).float().mean())


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {(r["kind"], r["q"]): r for r in rows}
    out: dict[str, Any] = {}
    for (kind, q), r in by.items():
        base = by.get(("train_untiled", 1) if kind.startswith("train") else ("untiled", 1))
        if base is None or r is base or kind.startswith("bn_train"):
            continue
        key = f"{kind}_q{q}"
        out[f"{key}_memory_ratio"] = round(r["peak_rss_mib"] / base["peak_rss_mib"], 3)
        out[f"{key}_memory_above_baseline_ratio"] = round(
            r["above_baseline_mib"] / max(base["above_baseline_mib"], 1e-9), 3)
        out[f"{key}_time_ratio"] = round(r["seconds"] / base["seconds"], 3)
        if kind == "tiled_two_pass" and ("tiled_one_pass", q) in by:
            out[f"two_pass_overhead_q{q}"] = round(
                r["seconds"] / by[("tiled_one_pass", q)]["seconds"], 3)
    return out


if __name__ == "__main__":
    main()
