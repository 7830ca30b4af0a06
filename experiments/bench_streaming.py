"""Streaming prediction of a huge raster file with a tiny model: memory, throughput, breakdown.

    .venv/bin/python experiments/bench_streaming.py            # 20000 x 20000 (fp32 10000), ~20 min
    .venv/bin/python experiments/bench_streaming.py --quick    # 2048 x 2048 smoke run

Target (issue): a 20000 x 20000 image predicted with a tiny model at peak RSS <= 2 GB
(checked as 2e9 bytes); report Mpix/s and where the time goes (read / model / write).

The input is the synthetic scene (``SceneGenerator``: 4-band uint8, tiled 256 x 256 zlib
TIFF), written once under ``data/bench/`` and reused. The model is the tiny same-padding
U-Net (levels 3, base width 8, 5 classes, untrained, eval). ``predict_raster`` runs in a
fresh process per variant so that its peak RSS is its own (``common.run_isolated``).

Steps, all in one run so ratios compare like with like on the shared cores:

1. baseline: the bare model on one in-memory tile per tile size (model + argmax, best of
   ``--repeats`` after a warm-up), converted to image pixels per second with the grid's E;
2. probe: ``predict_raster`` on a full-width strip (``--probe-rows`` x size) at each tile
   size, per path; the faster tile size is kept for the path;
3. full: ``predict_raster`` on the whole image, fast path (bf16 autocast + channels_last,
   model and input) and exact fp32 (at ``--fp32-size``, a top-left crop written as its own
   file when smaller than the image).

``streaming / baseline`` is the fraction of the bare model's speed the file-to-file run
keeps: 1 means reading, decoding, normalising and writing are fully hidden.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from common import add_harness_args, peak_rss_self_mib, run_isolated, save

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.data.sources.synthetic import write_scene
from seg_at_scale.data.synthetic import SceneGenerator
from seg_at_scale.models import UNet
from seg_at_scale.prediction import PredictOptions, predict_raster
from seg_at_scale.tiling import Window, make_grid

DATA = Path(__file__).resolve().parents[1] / "data" / "bench"
RSS_LIMIT_MIB = 2e9 / 2**20
PATHS = {"fp32": (None, False), "bf16_channels_last": (torch.bfloat16, True)}


def tiny_model(channels_last: bool) -> UNet:
    """The tiny same-padding U-Net (seeded, untrained: speed does not depend on weights)."""
    torch.manual_seed(0)
    net = UNet(4, 5, levels=3, convs_per_level=2, base_width=8, padding="same").eval()
    return net.to(memory_format=torch.channels_last) if channels_last else net


def ensure_scene(height: int, width: int, seed: int = 0) -> tuple[Path, float | None]:
    """Synthetic scene ``height x width`` under data/bench (reused); generation seconds."""
    DATA.mkdir(parents=True, exist_ok=True)
    image = DATA / f"scene_{height}x{width}_s{seed}.tif"
    if image.exists():
        return image, None
    t0 = time.perf_counter()
    write_scene(image, DATA / f"scene_{height}x{width}_s{seed}_mask.tif",
                SceneGenerator(seed, height, width), compression="zlib", overwrite=True)
    return image, time.perf_counter() - t0


def baseline_child(tile: int, path: str, repeats: int) -> dict[str, Any]:
    """Bare model + argmax on one in-memory ``tile x tile`` window of the scene."""
    autocast, cl = PATHS[path]
    net = tiny_model(cl)
    image, _ = SceneGenerator(0, tile, tile).render(Window(0, 0, tile, tile))
    x = torch.from_numpy(image).float().div_(255).unsqueeze(0)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    times = []
    fast = autocast is not None
    with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=fast):
        for _ in range(repeats + 1):  # the first call builds oneDNN kernels: warm-up
            t0 = time.perf_counter()
            net(x)[0].argmax(0).to(torch.uint8).numpy()
            times.append(time.perf_counter() - t0)
    return {"best_s": min(times[1:]), "median_s": statistics.median(times[1:])}


def predict_child(image: str, out: str, tile: int, path: str) -> dict[str, Any]:
    """``predict_raster`` file to file; stats plus this process's peak RSS."""
    autocast, cl = PATHS[path]
    opts = PredictOptions(tile_size=tile, fast=autocast is not None, overwrite=True,
                          layout="channels_last" if cl else "contiguous")
    s = predict_raster(tiny_model(cl), image, out, opts, normalizer=Normalizer(scale=1 / 255))
    return {"height": s.height, "width": s.width, "tile_size": tile, "tiles": s.tiles,
            "efficiency": round(s.efficiency, 4), "total_s": round(s.total_s, 2),
            "mpix_per_s": round(s.mpix_per_s, 3), "read_s": round(s.read_s, 2),
            "read_wait_s": round(s.read_wait_s, 2), "model_s": round(s.model_s, 2),
            "write_s": round(s.write_s, 2), "child_peak_rss_mib": round(peak_rss_self_mib(), 1),
            "class_pixels": s.class_pixels[:5]}


def stream(image: Path, tile: int, path: str) -> dict[str, Any]:
    """Run :func:`predict_child` isolated; add the sampled peak RSS and the time shares."""
    res = run_isolated(predict_child, str(image), str(DATA / f"pred_{image.stem}.tif"), tile,
                       path)
    if res["status"] != "ok":
        raise RuntimeError(f"predict_raster {image.name} tile {tile} {path}: {res['result']}")
    r = res["result"]
    r["peak_rss_mib"] = round(max(res["peak_rss_mib"], r.pop("child_peak_rss_mib")), 1)
    r["share"] = {k: round(r[f"{k}_s"] / r["total_s"], 3)
                  for k in ("read_wait", "model", "write")}
    r["read_share_overlapped"] = round(r["read_s"] / r["total_s"], 3)
    print(f"  {path:18s} {image.name} tile {tile}: {r['mpix_per_s']:.2f} Mpix/s, "
          f"{r['total_s']:.1f} s, peak {r['peak_rss_mib']:.0f} MiB, shares {r['share']}",
          flush=True)
    return r


def baselines(args: argparse.Namespace, size: int) -> dict[str, dict[str, Any]]:
    """Bare-model throughput per path and tile size, in tile and in image pixels."""
    fp = tiny_model(False).footprint()
    out: dict[str, dict[str, Any]] = {}
    for path in PATHS:
        for tile in args.tile_sizes:
            res = run_isolated(baseline_child, tile, path, args.repeats)
            if res["status"] != "ok":
                raise RuntimeError(f"baseline {path} tile {tile}: {res['result']}")
            e = make_grid(size, size, fp, tile_size=tile).efficiency
            t = res["result"]["best_s"]
            out[f"{path}/{tile}"] = {
                "tile_mpix_per_s": round(tile * tile / 1e6 / t, 3),
                "efficiency": round(e, 4),
                "image_mpix_per_s": round(tile * tile / 1e6 / t / e, 3),
                "median_tile_mpix_per_s": round(tile * tile / 1e6 / res["result"]["median_s"], 3),
                "peak_rss_mib": round(res["peak_rss_mib"], 1)}
            print(f"  baseline {path:18s} tile {tile}: {out[f'{path}/{tile}']}", flush=True)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=20000, help="image side (fast path)")
    p.add_argument("--fp32-size", type=int, default=10000,
                   help="image side of the fp32 run (reduced: fp32 is ~3x slower)")
    p.add_argument("--tile-sizes", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--probe-rows", type=int, default=2048, help="rows of the probe strip")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per baseline")
    add_harness_args(p, "1024 px scene (fp32: 512 px), tile 512, one timed call")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.fp32_size, args.tile_sizes = 1024, 512, [512]
        args.probe_rows, args.repeats = 512, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load0 = os.getloadavg()
    image, gen_s = ensure_scene(args.size, args.size)
    probe, _ = ensure_scene(args.probe_rows, args.size)
    print(f"scene {image.name}" + (f" generated in {gen_s:.1f} s" if gen_s else " (reused)"))
    print("baseline: bare model on one in-memory tile")
    base = baselines(args, args.size)
    print(f"probe: full-width strip {args.probe_rows} x {args.size}")
    probes = {f"{p}/{t}": stream(probe, t, p) for p in PATHS for t in args.tile_sizes}
    best = {p: max(args.tile_sizes, key=lambda t, p=p: probes[f"{p}/{t}"]["mpix_per_s"])
            for p in PATHS}
    print(f"full runs with tile sizes {best}")
    fp32_image = image if args.fp32_size == args.size else ensure_scene(
        args.fp32_size, args.fp32_size)[0]
    full = {"bf16_channels_last": stream(image, best["bf16_channels_last"],
                                         "bf16_channels_last"),
            "fp32": stream(fp32_image, best["fp32"], "fp32")}
    for path, r in full.items():
        b = base[f"{path}/{r['tile_size']}"]
        r["baseline_image_mpix_per_s"] = b["image_mpix_per_s"]
        r["streaming_over_baseline"] = round(r["mpix_per_s"] / b["image_mpix_per_s"], 3)
        r["peak_rss_ok"] = r["peak_rss_mib"] <= RSS_LIMIT_MIB
    fast = full["bf16_channels_last"]
    save("bench_streaming", {
        "model": "UNet(4 bands, 5 classes, levels=3, convs_per_level=2, base_width=8, same)",
        "footprint": str(tiny_model(False).footprint()),
        "input": {"path": str(image.relative_to(DATA.parents[1])), "generated_s": gen_s,
                  "format": "4-band uint8 tiled 256x256 zlib TIFF (SceneGenerator seed 0)"},
        "target": {"size": 20000, "peak_rss_mib_max": round(RSS_LIMIT_MIB, 1)},
        "result": {"size": args.size, "mpix_per_s": fast["mpix_per_s"],
                   "total_s": fast["total_s"], "peak_rss_mib": fast["peak_rss_mib"],
                   "pass": bool(fast["peak_rss_ok"] and full["fp32"]["peak_rss_ok"]
                                and args.size >= 20000)},
        "baseline": base, "probe": probes, "chosen_tile_size": best, "full": full,
        "threads": torch.get_num_threads(), "load_avg_start_end": [load0, os.getloadavg()],
    }, args.out)


if __name__ == "__main__":
    main()
