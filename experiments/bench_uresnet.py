"""UResNet (CosmicTagger preset) on this CPU: training throughput and memory, tiled vs untiled.

    .venv/bin/python experiments/bench_uresnet.py               # throughput + memory, ~5 min
    .venv/bin/python experiments/bench_uresnet.py --max-gib 20  # also run full resolution
    .venv/bin/python experiments/bench_uresnet.py --max-gib 20 --free-frac 0.85  # untiled too
    .venv/bin/python experiments/bench_uresnet.py --train       # learning run + real-file test

Throughput (``results/bench_uresnet.json``): one exact whole-image training step (forward,
backward of the balanced mean loss, AdamW update) of the CosmicTagger-like UResNet
(depth 6, 16 filters, 2 blocks per layer, additive growth, no batch norm, fp32, batch 1)
on a synthetic 3 x 1280 x 2048 event max-pooled by 4, 2 and 1. Each variant runs in a fresh
process (``common.run_isolated``: its own peak RSS); one warm-up step, then timed steps.
Tiled vs untiled at full resolution: ``tiled_backward`` with the exact halo (606 px,
context 608) cuts the width into two tiles (``q = (1, 2)``); with 1280 rows and a
608-pixel context no finer split helps. A variant whose peak memory, predicted from the
runs already done (``a + b * pixels``), exceeds ``--max-gib`` or ``--free-frac`` of the
memory available is not run (the machine may be shared) and its figures are the
prediction, marked ``extrapolated``.

Learning run (``--train``, ``results/bench_uresnet_train.json``): ``seg-train`` on the
synthetic events at downsample 4 (3 x 320 x 512), small UResNet, whole-image steps, for at
most ``--minutes``; the validation mIoU (cosmic / neutrino) per epoch with wall time; then
the best checkpoint on the real file's 5 events at the same downsampling (a smoke test).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from common import add_harness_args, run_isolated, save

from seg_at_scale.data.sources.cosmic import downsample_event, read_cosmic_h5, synthetic_event
from seg_at_scale.models import URESNET_SIZES, UResNet
from seg_at_scale.tasks.cosmic import CosmicLoss, cosmic_confusion, cosmic_metrics
from seg_at_scale.tiling import make_grid, tiled_backward

ROOT = Path(__file__).resolve().parents[1]
REAL = Path(os.environ.get("COSMIC_H5", ROOT / "data" / "cosmic_tagging_light.h5"))
FULL = (1280, 2048)
SCALE = 0.02  # conf/data/cosmic.yaml


def _event(ds: int) -> tuple[torch.Tensor, torch.Tensor]:
    ev = downsample_event(synthetic_event(*FULL, seed=0), ds)
    return (torch.from_numpy(ev.image * SCALE)[None],
            torch.from_numpy(ev.labels.astype(np.int64))[None])


def train_steps(ds: int, steps: int, q: tuple[int, int] | None,
                preset: str = "cosmic") -> dict[str, Any]:
    """Child process: ``steps`` timed exact whole-image steps after one warm-up."""
    torch.manual_seed(0)
    net = UResNet(**URESNET_SIZES[preset].kwargs(), batch_norm=False)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    loss = CosmicLoss(3, 3, "light")
    x, t = _event(ds)
    times = []
    for k in range(steps + 1):
        t0 = time.perf_counter()
        if q is None:
            s, w = loss(net(x), t)
            value = s / w
            value.backward()
        else:
            value = tiled_backward(net, x, t, loss, q=q)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if k:
            times.append(time.perf_counter() - t0)
    return {"s_per_step": float(np.mean(times)), "best_s": float(min(times)),
            "loss": float(value.detach())}


def _predict_mib(fit: tuple[float, float] | None, pixels: int) -> float | None:
    return None if fit is None else fit[0] + fit[1] * pixels


def _fit(rows: list[dict[str, Any]], key: str) -> tuple[float, float] | None:
    pts = [(r["pixels"], r[key]) for r in rows if not r.get("extrapolated")]
    if len(pts) < 2:
        return None
    b, a = np.polyfit([p for p, _ in pts], [m for _, m in pts], 1)
    return float(a), float(b)


def _variant(name: str, ds: int, steps: int, q: tuple[int, int] | None, pixels: int,
             rows: list[dict[str, Any]], max_gib: float,
             computed_pixels: int | None = None, free_frac: float = 0.7,
             preset: str = "cosmic") -> dict[str, Any]:
    """One row; ``pixels``: the largest forward (memory), ``computed_pixels``: all (time)."""
    mem_fit, time_fit = _fit(rows, "peak_rss_mib"), _fit(rows, "s_per_step")
    predicted = _predict_mib(mem_fit, pixels)
    computed = computed_pixels or pixels
    free_mib = psutil.virtual_memory().available / 2**20
    row: dict[str, Any] = {"variant": name, "downsample": ds, "q": q, "pixels": pixels,
                           "predicted_peak_mib": None if predicted is None else round(predicted)}
    if predicted is not None and (predicted > max_gib * 1024 or predicted > free_frac * free_mib):
        assert time_fit is not None
        tiles = computed // pixels  # a tiled step runs one forward/backward per tile
        row |= {"extrapolated": True, "peak_rss_mib": round(predicted),
                "s_per_step": round(tiles * (time_fit[0] + time_fit[1] * pixels), 2),
                "why": f"predicted {predicted / 1024:.1f} GiB > --max-gib {max_gib} or "
                       f"{free_frac:.0%} of the {free_mib / 1024:.1f} GiB free"}
    else:
        out = run_isolated(train_steps, ds, steps, q, preset)
        if out["status"] != "ok":
            raise RuntimeError(f"{name}: {out['result']}")
        row |= {"peak_rss_mib": round(out["peak_rss_mib"]), **out["result"]}
    row["images_per_s"] = round(1 / row["s_per_step"], 4)
    print(json.dumps(row), flush=True)
    return row


def throughput(args: argparse.Namespace) -> None:
    load0 = os.getloadavg()
    torch.set_num_threads(os.cpu_count() or 1)
    rows: list[dict[str, Any]] = []
    # --quick: the tiny preset, downsampled 16 / 8 / 4 untiled, the tiled step at 4
    preset, top = ("tiny", 4) if args.quick else ("cosmic", 1)
    steps_of = ((16, 1), (8, 1), (4, 1)) if args.quick else ((4, 2), (2, 1), (1, 1))
    for ds, steps in steps_of:
        px = FULL[0] * FULL[1] // ds**2
        rows.append(_variant(f"untiled_ds{ds}", ds, steps, None, px, rows, args.max_gib,
                             free_frac=args.free_frac, preset=preset))
    net = UResNet(**URESNET_SIZES[preset].kwargs(), batch_norm=False)
    fp = net.footprint()
    grid = make_grid(FULL[0] // top, FULL[1] // top, fp, q=(1, 2))
    tile_px = max(t.read.area for t in grid)
    tiled = _variant("tiled_full_q1x2", top, 1, (1, 2), tile_px, rows, args.max_gib,
                     computed_pixels=sum(t.read.area for t in grid), free_frac=args.free_frac,
                     preset=preset)
    untiled = rows[-1]
    save("bench_uresnet", {
        "quick": args.quick,
        "model": {"preset": preset, **URESNET_SIZES[preset].kwargs(),
                  "growth": "additive", "batch_norm": False,
                  "parameters": sum(p.numel() for p in net.parameters()),
                  "halo": fp.halo, "context": fp.context, "align": fp.align},
        "event": "synthetic 3 x 1280 x 2048, max-pooled by the downsample factor; batch 1",
        "rows": rows + [tiled],
        "tiled_vs_untiled_full": {
            "grid": list(grid.shape), "tile_reads": [[t.read.height, t.read.width] for t in grid],
            "efficiency_E": round(grid.efficiency, 3),
            "memory_ratio": round(tiled["peak_rss_mib"] / untiled["peak_rss_mib"], 3),
            "time_ratio": round(tiled["s_per_step"] / untiled["s_per_step"], 3),
            "note": "the exact context (608 px) is half the image height: two tiles along "
                    "the width is the only useful split, so tiling saves little at 1280 x 2048"},
        "reference": "CosmicTagger reports ~3.4 images/s per A100 (DDP) at full resolution",
        "loadavg_start": load0, "loadavg_end": os.getloadavg(),
    }, args.out)


# ----- the learning run --------------------------------------------------------------------


def _metrics_csv(run: Path) -> list[dict[str, str]]:
    files = sorted(run.rglob("metrics.csv"))
    with files[-1].open() as f:
        return [r for r in csv.DictReader(f) if r.get("val/miou")]


def evaluate_real(run: Path, ckpt: str, ds: int) -> dict[str, Any]:
    """The trained model on the real file's events (max-pooled by ``ds``): cosmic metrics."""
    from seg_at_scale.models.trained import load_run

    net = load_run(run, ckpt).model  # the registry's network, the checkpoint as plain data
    cm = torch.zeros(3, 3, 3, dtype=torch.int64)
    per_event = []
    for ev in read_cosmic_h5(REAL, downsample=ds):
        x = torch.from_numpy(ev.image * SCALE)[None]
        t = torch.from_numpy(ev.labels.astype(np.int64))[None]
        with torch.no_grad():
            pred = net(x).reshape(1, 3, 3, *x.shape[-2:]).argmax(2)
        c = cosmic_confusion(pred, t)
        per_event.append(round(cosmic_metrics(c)["miou"], 4))
        cm += c
    m = cosmic_metrics(cm)
    return {"events": len(per_event), "miou_per_event": per_event,
            **{k: round(v, 4) for k, v in m.items() if not k.startswith("plane")}}


def learn(args: argparse.Namespace) -> None:
    load0 = os.getloadavg()
    tmp = Path(args.workdir)
    run = Path(args.run) if args.run else tmp / f"run_{time.strftime('%H%M%S')}"
    overrides = ["experiment=cosmic_uresnet", "model=uresnet_small",
                 "data.synthetic.height=320", "data.synthetic.width=512",
                 "data.synthetic.options.downsample=4",
                 "data.synthetic.splits={train:64,val:8}", f"data.root={tmp / 'data'}",
                 f"trainer.max_epochs={args.epochs}",
                 f"trainer.max_time=00:00:{args.minutes:02d}:00",
                 "trainer.enable_progress_bar=false", "logger=csv", f"hydra.run.dir={run}"]
    if args.run:  # summarise a finished run: its own overrides, wall time from its files
        import yaml

        overrides = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
        wall = (run / "summary.json").stat().st_mtime - (run / "run_config.yaml").stat().st_mtime
    else:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "seg_at_scale.cli.train", *overrides],
                             capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t0
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
    summary = json.loads((run / "summary.json").read_text())
    epochs = [{"epoch": int(r["epoch"]), "step": int(r["step"]),
               "val_miou": round(float(r["val/miou"]), 4),
               "val_iou_cosmic": round(float(r["val/iou_cosmic"]), 4),
               "val_iou_neutrino": round(float(r["val/iou_neutrino"]), 4),
               "val_acc_nonbg": round(float(r["val/acc_nonbg"]), 4)}
              for r in _metrics_csv(run)]
    best = max(e["val_miou"] for e in epochs)
    real = evaluate_real(run, summary["checkpoint"], 4) if REAL.exists() else None
    save("bench_uresnet_train", {
        "command": "seg-train " + " ".join(overrides),
        "wall_s": round(wall, 1), "epochs": epochs,
        "best_val_miou": best, "target": ">= 0.7 non-background mIoU within 15 min",
        "passed": best >= 0.7 and wall <= 15 * 60 + 120,
        "real_file_ds4_smoke_test": real,
        "note": args.note, "loadavg_start": load0, "loadavg_end": os.getloadavg(),
    }, args.out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-gib", type=float, default=8.0,
                    help="run a variant only if its predicted peak memory is below this")
    ap.add_argument("--free-frac", type=float, default=0.7,
                    help="... and below this fraction of the memory now available")
    ap.add_argument("--train", action="store_true", help="the learning run instead")
    ap.add_argument("--minutes", type=int, default=15)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--note", default="", help="free text saved with the learning run")
    ap.add_argument("--run", help="summarise this finished run folder instead of training")
    ap.add_argument("--workdir", default="/tmp/bench_uresnet_runs",
                    help="data and run folders of the learning run (outside the repo)")
    add_harness_args(ap, "the tiny preset on the event downsampled by 16, 8 and 4 (tiled)")
    args = ap.parse_args(argv)
    learn(args) if args.train else throughput(args)


if __name__ == "__main__":
    main()
