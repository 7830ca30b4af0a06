"""The COG written beside the tiles against after the last tile, with every core and one free.

    .venv/bin/python experiments/bench_finalize_beside.py           # ~2 min on 2 cores
    .venv/bin/python experiments/bench_finalize_beside.py --quick   # a 1024^2 scene (smoke)

In one process ``predict_raster`` finalises the COG beside the tiles (``finalize_beside``:
each row band of the store is read once its chunks are on disk) instead of after the last
tile. On a GPU the host's cores are free while the device computes; on the CPU the
network's threads take them. This measures both where no GPU is lent: the 8192^2 4-band
scene (256^2 zlib tiles) to a COG by the near-free U-Net (2 levels of width 2), with torch
on every core (``all_cores``) and on all but one (``core_free``, as a GPU host leaves
them), and on two ranks of one thread each (``two_ranks``: rank 0 writes each row band
once both ranks' chunks of it are on disk, the other rank no longer waits for it after its
last tile), the two ways alternated ``--repeats`` times: seconds in all (rank 0's with
two), the model's, the finalisation's after the last tile, and the two COGs compared byte
for byte.
"""

from __future__ import annotations

import argparse
import json
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
from seg_at_scale.parallel.launch import spawn
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
    image = synthetic_scene(DATA, args.side)
    torch.manual_seed(0)
    net = UNet(4, 5, levels=2, base_width=2).eval()
    options = PredictOptions(progress=False)
    cores = os.cpu_count() or 2
    figures: dict[str, object] = {"side": args.side, "network": "UNet levels 2, width 2",
                                  "tile_size": options.tile_size}
    for case, threads in (("all_cores", cores), ("core_free", max(1, cores - 1))):
        torch.set_num_threads(threads)
        figures[case] = {"torch_threads": threads, **_alternated(net, image, options,
                                                                 args.repeats)}
    figures["two_ranks"] = {"torch_threads": 1, **_alternated(net, image, options,
                                                              args.repeats, ranks=2)}
    save("bench_finalize_beside", figures, args.out)


def _ranked(rank: int, world: int, net: torch.nn.Module, image: Path, out: Path,
            options: PredictOptions, way: str) -> None:
    """One of ``world`` ranks; rank 0 writes its figures beside ``out``."""
    raster_module.finalize_beside = lambda *a: way == "beside"  # this process only
    t0 = time.perf_counter()
    stats = predict_raster(net, image, out, options)
    if rank == 0:
        out.with_suffix(".json").write_text(json.dumps(_figures(stats, t0)))


def _figures(stats: object, t0: float) -> dict[str, float]:
    return {"s": round(time.perf_counter() - t0, 3),
            **{k: round(getattr(stats, k), 3) for k in ("model_s", "read_s", "finalize_s")}}


def _alternated(net: torch.nn.Module, image: Path, options: PredictOptions,
                repeats: int, ranks: int = 1) -> dict[str, object]:
    runs: dict[str, list[dict[str, float]]] = {"after": [], "beside": []}
    cogs: dict[str, bytes] = {}
    tmp = Path(tempfile.mkdtemp(prefix="finalize-beside-"))
    chosen = raster_module.finalize_beside
    try:
        for _ in range(repeats):
            for way in runs:
                out = tmp / way / "out.tif"
                shutil.rmtree(out.parent, ignore_errors=True)
                out.parent.mkdir()
                if ranks > 1:
                    spawn(_ranked, ranks, net, image, out, options, way, threads=1)
                    runs[way].append(json.loads(out.with_suffix(".json").read_text()))
                else:
                    raster_module.finalize_beside = lambda *a, w=way: w == "beside"
                    t0 = time.perf_counter()
                    runs[way].append(_figures(predict_raster(net, image, out, options), t0))
                print(way, ranks, torch.get_num_threads(), runs[way][-1], flush=True)
                cogs[way] = out.read_bytes()
    finally:
        raster_module.finalize_beside = chosen
        shutil.rmtree(tmp, ignore_errors=True)
    median = {way: statistics.median(r["s"] for r in rs) for way, rs in runs.items()}
    return {"runs": runs, "median_s": median,
            "after_over_beside": round(median["after"] / median["beside"], 3),
            "finalize_after_last_tile_s": {way: statistics.median(r["finalize_s"] for r in rs)
                                           for way, rs in runs.items()},
            "same_bytes": cogs["after"] == cogs["beside"]}


if __name__ == "__main__":
    main()
