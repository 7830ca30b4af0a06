"""The exact fp32 prediction path in channels-last (``layout=auto``) against contiguous NCHW.

    .venv/bin/python experiments/bench_layout.py            # ~2 min on 2 cores

``seg-predict fast=false`` of one raster (the demo's U-Net size: 4 levels, width 16, same
padding; 4-band uint8, tile 1024, COG output), run as the user runs it, in a fresh process
per run, alternating ``layout=contiguous`` and ``layout=auto`` so that the machine's drift
falls on both. Figures: the ``seconds`` and ``model_s`` seg-predict reports, their ratio, and
the labels of the two outputs compared pixel by pixel (the fingerprint tag differs: it records
the layout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import rasterio
from common import add_harness_args, save

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from helpers.prediction import make_image, make_model, make_run  # noqa: E402

LAYOUTS = ("contiguous", "auto")


def predict(run: Path, image: Path, out: Path, layout: str, tile: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "seg_at_scale.cli.predict", f"run={run}", f"image={image}",
           f"output={out}", "fast=false", f"layout={layout}", f"tile_size={tile}",
           "preview=false", "stac=false", "progress=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True,
                          env={**os.environ, "CI": "true"})
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", type=int, default=2048, help="raster side")
    ap.add_argument("--tile", type=int, default=1024, help="tile_size")
    ap.add_argument("--repeats", type=int, default=3, help="runs per layout")
    add_harness_args(ap, "512^2 raster, tile 256, one run per layout")
    args = ap.parse_args(argv)
    if args.quick:
        args.side, args.tile, args.repeats = 512, 256, 1
    with tempfile.TemporaryDirectory(prefix="bench-layout-") as name:
        tmp = Path(name)
        run = make_run(tmp / "run", make_model("same", levels=4, width=16))
        image = make_image(tmp / "scene.tif", args.side, args.side)
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in LAYOUTS}
        for k in range(args.repeats):
            for layout in LAYOUTS:
                res = predict(run, image, tmp / f"{layout}{k}" / "mask.tif", layout, args.tile)
                runs[layout].append({"seconds": res["seconds"], "model_s": res["model_s"],
                                     "load": [round(x, 2) for x in os.getloadavg()]})
        labels = {k: rasterio.open(tmp / f"{k}0" / "mask.tif").read(1) for k in LAYOUTS}
    median = {k: {key: statistics.median(r[key] for r in runs[k]) for key in ("seconds",
                                                                            "model_s")}
              for k in LAYOUTS}
    save("bench_layout", {
        "problem": f"seg-predict fast=false, {args.side}^2 4-band uint8, U-Net 4 levels width 16 "
                   f"same padding, tile_size={args.tile}, COG output",
        "runs": runs, "median": median,
        "speedup_seconds": round(median["contiguous"]["seconds"] / median["auto"]["seconds"], 3),
        "speedup_model": round(median["contiguous"]["model_s"] / median["auto"]["model_s"], 3),
        "labels_differing": int(np.count_nonzero(labels["contiguous"] != labels["auto"]))},
        args.out)


if __name__ == "__main__":
    main()
