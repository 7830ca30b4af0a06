"""The COG written beside the tiles against after the last tile, on the CPU with a core left.

    .venv/bin/python experiments/bench_finalize_beside.py           # ~1 min on 2 cores
    .venv/bin/python experiments/bench_finalize_beside.py --quick   # a 1024^2 scene (smoke)

On one GPU ``predict_raster`` finalises the COG beside the tiles (``finalize_beside``: each
row band of the store is read once its chunks are on disk) instead of after the last tile,
because the host's cores are free while the device computes. This measures that mechanism
where no GPU is lent: the 8192^2 4-band scene (256^2 zlib tiles) to a COG by the near-free
U-Net (2 levels of width 2), with torch on all cores but one (the one a GPU host leaves
free), the two ways alternated ``--repeats`` times: seconds in all, the model's, the
finalisation's after the last tile, and the two COGs compared byte for byte.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import seg_at_scale.cli  # noqa: F401 - before torch: huge pages for torch's tensors, as the commands run

# isort: split
import torch
from common import add_harness_args, save, synthetic_scene

from seg_at_scale.models import UNet
from seg_at_scale.prediction import PredictOptions, predict_raster
from seg_at_scale.prediction import raster as raster_module

DATA = Path(__file__).resolve().parents[1] / "data" / "bench" / "feed"  # bench_feed's scene


def main(argv: list[str] | None = None) -> None:
    parser = add_harness_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]),
                              "a 1024^2 scene, one repeat")
    parser.add_argument("--side", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.side, args.repeats = 1024, 1
    threads = max(1, (os.cpu_count() or 2) - 1)
    torch.set_num_threads(threads)
    image = synthetic_scene(DATA, args.side)
    torch.manual_seed(0)
    net = UNet(4, 5, levels=2, base_width=2).eval()
    options = PredictOptions(progress=False)
    runs: dict[str, list[dict[str, float]]] = {"after": [], "beside": []}
    cogs: dict[str, bytes] = {}
    tmp = Path(tempfile.mkdtemp(prefix="finalize-beside-"))
    chosen = raster_module.finalize_beside
    try:
        for _ in range(args.repeats):
            for way in runs:
                out = tmp / way / "out.tif"
                shutil.rmtree(out.parent, ignore_errors=True)
                out.parent.mkdir()
                raster_module.finalize_beside = lambda *a, w=way: w == "beside"
                t0 = time.perf_counter()
                stats = predict_raster(net, image, out, options)
                runs[way].append({"s": round(time.perf_counter() - t0, 3),
                                  "model_s": round(stats.model_s, 3),
                                  "read_s": round(stats.read_s, 3),
                                  "finalize_s": round(stats.finalize_s, 3)})
                print(way, runs[way][-1], flush=True)
                cogs[way] = out.read_bytes()
    finally:
        raster_module.finalize_beside = chosen
        shutil.rmtree(tmp, ignore_errors=True)
    median = {way: statistics.median(r["s"] for r in rs) for way, rs in runs.items()}
    save("bench_finalize_beside", {
        "side": args.side, "torch_threads": threads, "network": "UNet levels 2, width 2",
        "tile_size": options.tile_size, "runs": runs,
        "median_s": median, "after_over_beside": round(median["after"] / median["beside"], 3),
        "finalize_after_last_tile_s": {way: statistics.median(r["finalize_s"] for r in rs)
                                       for way, rs in runs.items()},
        "same_bytes": cogs["after"] == cogs["beside"]}, args.out)


if __name__ == "__main__":
    main()
