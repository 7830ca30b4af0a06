"""Moonshot: a 50,000 x 50,000 4-band synthetic scene predicted end to end on this machine.

    .venv/bin/python experiments/bench_moonshot.py            # 50000 x 50000, ~12 min (quiet)
    .venv/bin/python experiments/bench_moonshot.py --quick    # 4096 x 4096 smoke run

Target (issue): a 50,000 x 50,000 4-band image (2.5 gigapixels, written by the synthetic
generator) predicted end to end on this 2-core machine in under 10 minutes with bounded
memory; report how close we get and what limits it.

Steps (each figure says whether it was measured or extrapolated):

1. disk check: refuse unless free space >= 2x what the run writes (image, mask, output);
2. compression probe: a full-width strip of ``--probe-rows`` rows written raw and with zlib
   (time and size), to justify ``--compression`` of the scene;
3. strip: a full-width ``--strip-rows`` x 50,000 band of the same scene (the generator is a
   pure function of the pixel coordinates, so it *is* the scene's top band) is generated
   and predicted at each ``--tile-sizes``; the whole-scene time is extrapolated from it;
4. full: when the extrapolated prediction fits ``--max-full-min``, the whole scene is
   generated (timed on its own) and predicted in a fresh process (peak RSS); otherwise the
   strip figures and the extrapolation are the result.

Prediction is ``predict_raster`` with the tiny same-padding U-Net (levels 3, base width 8,
untrained) in the fast path: bf16 autocast + channels_last (model and input). The big
files are deleted at the end unless ``--keep`` (then they are reused by the next run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import add_harness_args, peak_rss_self_mib, run_isolated, save

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.data.sources.synthetic import write_scene
from seg_at_scale.data.synthetic import SceneGenerator
from seg_at_scale.io import write_raster_bands
from seg_at_scale.models import UNet
from seg_at_scale.prediction import PredictOptions, predict_raster
from seg_at_scale.tiling import Window

DATA = Path(__file__).resolve().parents[1] / "data" / "bench" / "moonshot"
BANDS = 4


def tiny_model() -> UNet:
    torch.manual_seed(0)
    net = UNet(BANDS, 5, levels=3, convs_per_level=2, base_width=8, padding="same").eval()
    return net.to(memory_format=torch.channels_last)


def check_disk(height: int, width: int) -> dict[str, float]:
    """Refuse (SystemExit) unless free space >= 2x image + mask + output bytes."""
    DATA.mkdir(parents=True, exist_ok=True)
    need = height * width * (BANDS + 1 + 1) / 1e9  # uint8 image, mask, output (raw bound)
    free = shutil.disk_usage(DATA).free / 1e9
    if free < 2 * need:
        raise SystemExit(f"bench_moonshot: {DATA} has {free:.1f} GB free but a "
                         f"{height} x {width} run writes up to {need:.1f} GB; free at least "
                         f"{2 * need:.1f} GB (2x) or pass a smaller --size")
    return {"free_gb": round(free, 1), "needed_gb": round(need, 1)}


def compression_probe(rows: int, width: int) -> dict[str, Any]:
    """Write the scene's top ``rows`` full-width rows raw and zlib: seconds and bytes."""
    gen = SceneGenerator(0, rows, width)
    out: dict[str, Any] = {"rows": rows, "width": width}
    t0 = time.perf_counter()
    image = gen.render(Window(0, 0, rows, width))[0]
    out["render_s"] = round(time.perf_counter() - t0, 2)
    for name in ("none", "zlib"):
        path = DATA / f"probe_{name}.tif"
        t0 = time.perf_counter()
        write_raster_bands(path, image.shape, np.uint8, iter([image]),
                           compression=None if name == "none" else name, overwrite=True)
        out[name] = {"write_s": round(time.perf_counter() - t0, 2),
                     "bytes_per_pixel": round(path.stat().st_size / (rows * width), 3)}
        path.unlink()
    print(f"compression probe: {out}", flush=True)
    return out


def ensure_scene(height: int, width: int, compression: str | None) -> tuple[Path, float | None]:
    """The scene (image + mask) under DATA, reused if present; generation seconds if made."""
    image = DATA / f"scene_{height}x{width}_{compression or 'raw'}.tif"
    if image.exists():
        return image, None
    print(f"generating {image.name} ...", flush=True)
    t0 = time.perf_counter()
    write_scene(image, image.with_name(image.stem + "_mask.tif"), SceneGenerator(0, height, width),
                compression=compression, overwrite=True)
    seconds = time.perf_counter() - t0
    print(f"  {height * width / 1e6:.0f} Mpix in {seconds:.1f} s", flush=True)
    return image, seconds


def load_model(run: str) -> tuple[torch.nn.Module, Normalizer]:
    """A trained run's network and normaliser (``--run``), else the untrained tiny U-Net."""
    if not run:
        return tiny_model(), Normalizer(scale=1 / 255)
    from seg_at_scale.models.trained import load_run

    trained = load_run(run)
    return trained.model.to(memory_format=torch.channels_last), trained.normalizer


def predict_child(image: str, out: str, tile: int, run: str = "") -> dict[str, Any]:
    """``predict_raster`` in the fast path (a COG out); stats and this process's peak RSS."""
    net, norm = load_model(run)
    s = predict_raster(net, image, out, PredictOptions(tile_size=tile, fast=True, overwrite=True,
                                                       resume=False, progress=False),
                       normalizer=norm)
    return {"height": s.height, "width": s.width, "tile_size": tile, "tiles": s.tiles,
            "efficiency": round(s.efficiency, 4), "total_s": round(s.total_s, 1),
            "mpix_per_s": round(s.mpix_per_s, 3), "read_s": round(s.read_s, 1),
            "read_wait_s": round(s.read_wait_s, 1), "model_s": round(s.model_s, 1),
            "write_s": round(s.write_s, 1), "finalize_s": round(s.finalize_s, 1),
            "child_peak_rss_mib": peak_rss_self_mib()}


def predict(image: Path, tile: int, run: str = "") -> dict[str, Any]:
    out = image.with_name(image.stem + f"_pred{tile}.tif")
    res = run_isolated(predict_child, str(image), str(out), tile, run, poll_s=0.05)
    if res["status"] != "ok":
        raise RuntimeError(f"predict_raster {image.name} tile {tile}: {res['result']}")
    r = res["result"]
    r["peak_rss_mib"] = round(max(res["peak_rss_mib"], r.pop("child_peak_rss_mib")), 1)
    r["wall_s_with_process_start"] = round(res["wall_s"], 1)
    r["output_bytes"] = out.stat().st_size
    r["share"] = {k: round(r[f"{k}_s"] / r["total_s"], 3)
                  for k in ("read_wait", "model", "write", "finalize")}
    print(f"  {image.name} tile {tile}: {r['total_s']:.1f} s, {r['mpix_per_s']:.2f} Mpix/s, "
          f"peak {r['peak_rss_mib']:.0f} MiB, shares {r['share']}", flush=True)
    return r


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=50000, help="scene side")
    p.add_argument("--tile-sizes", type=int, nargs="+", default=[2048],
                   help="tile sizes tried on the strip; the fastest is used for the scene")
    p.add_argument("--strip-rows", type=int, default=4096, help="rows of the measured strip")
    p.add_argument("--probe-rows", type=int, default=512, help="rows of the compression probe")
    p.add_argument("--compression", default="none", help="scene TIFF compression (none|zlib)")
    p.add_argument("--max-full-min", type=float, default=30.0,
                   help="run the whole scene only if its extrapolated prediction fits")
    p.add_argument("--target-min", type=float, default=15.0, help="the issue's time target")
    p.add_argument("--keep", action="store_true", help="keep (and reuse) the big files")
    p.add_argument("--run", default="", help="a trained run folder (e.g. the demo's); "
                   "default: the untrained tiny U-Net")
    add_harness_args(p, "4096 px scene, 1024-row strip, tile 1024")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.strip_rows, args.probe_rows, args.tile_sizes = 4096, 1024, 256, [1024]
    args.compression = None if args.compression.lower() == "none" else args.compression
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load0, n = os.getloadavg(), args.size
    disk = check_disk(n, n)
    probe = compression_probe(args.probe_rows, n)
    strip, strip_gen_s = ensure_scene(args.strip_rows, n, args.compression)
    print(f"strip {args.strip_rows} x {n}")
    runs = {t: predict(strip, t, args.run) for t in args.tile_sizes}
    tile = min(runs, key=lambda t: runs[t]["total_s"])
    scale = n / args.strip_rows
    est = {"from": f"strip {args.strip_rows} x {n}, tile {tile} (measured) x {scale:.2f}",
           "predict_s": round(runs[tile]["total_s"] * scale, 1),
           "generate_s": round(strip_gen_s * scale, 1) if strip_gen_s else None}
    print(f"extrapolated whole-scene prediction: {est['predict_s'] / 60:.1f} min", flush=True)
    full: dict[str, Any] = {"ran": est["predict_s"] <= args.max_full_min * 60}
    made: list[Path] = [strip]
    if full["ran"]:
        image, gen_s = ensure_scene(n, n, args.compression)
        made.append(image)
        full.update(generate_s=None if gen_s is None else round(gen_s, 1),
                    image_bytes=image.stat().st_size, **predict(image, tile, args.run))
    else:
        full["reason"] = (f"extrapolated {est['predict_s'] / 60:.1f} min > --max-full-min "
                          f"{args.max_full_min}")
    best = full if full["ran"] else {"total_s": est["predict_s"],
                                     "peak_rss_mib": runs[tile]["peak_rss_mib"]}
    figures = {
        "model": (f"trained run {args.run}" if args.run else
                  "UNet(4 bands, 5 classes, levels=3, convs_per_level=2, base_width=8, same)")
                 + ", bf16 autocast + channels_last; output: COG with overviews",
        "size": n, "gigapixels": n * n / 1e9, "disk": disk, "compression_probe": probe,
        "scene_compression": args.compression or "none",
        "strip": {"rows": args.strip_rows, "generate_s": strip_gen_s, "runs": runs},
        "extrapolated": est, "full": full,
        "result": {"measured": bool(full["ran"]),
                   "predict_min": round(best["total_s"] / 60, 2),
                   "mpix_per_s": round(n * n / 1e6 / best["total_s"], 2),
                   "peak_rss_mib": best["peak_rss_mib"],
                   "target_min": args.target_min,
                   "pass": bool(full["ran"] and best["total_s"] <= args.target_min * 60),
                   "speedup_needed": round(best["total_s"] / (args.target_min * 60), 2)},
        "load_avg_start_end": [load0, os.getloadavg()],
    }
    name = "bench_moonshot" + ("_trained" if args.run else "")
    save(name, figures, args.out)
    if not args.keep:
        for path in made:
            for f in path.parent.glob(path.stem + "*"):
                f.unlink()
        print(f"deleted the scene files under {DATA} (pass --keep to keep them)")
    print(json.dumps(figures["result"]))


if __name__ == "__main__":
    main()
