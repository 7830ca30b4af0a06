"""Is the file path bound by the network? ``seg-predict`` against GDAL and against the bare model.

    .venv/bin/python experiments/bench_feed.py            # 8192^2, 3 alternations
    .venv/bin/python experiments/bench_feed.py --quick    # 1536^2, 1 alternation (smoke)

Two comparisons, each alternated in one run so that the shared cores' drift cancels:

1. ``gdal``: a near-free U-Net (2 levels of width 2: a few thousand multiply-adds per
   pixel) predicts the 8192^2 4-band scene (256^2 zlib tiles, as satellite products come)
   to a COG with ``seg-predict`` (the whole command, fast path), against GDAL copying the
   same scene to a DEFLATE COG with all cores (``gdal_translate -of COG``). The ratio is
   GDAL's seconds over ours: 1.0 means the prediction costs what reading the scene and
   writing a COG costs; below, the pixels' way around the network costs more than GDAL's.
2. ``bare``: the demo's U-Net (levels 4, width 16), ``tile_size=auto``, file to COG, in
   process (``predict_scene``) and as the whole ``seg-predict`` command, against the same
   network on the same tiles already in memory (normalised, in the layout and precision
   the prediction takes: bf16 channels-last where the CPU has bfloat16 kernels, float32
   where it would be emulated; cores cropped, labels made): the bare model's seconds over
   the file path's. This process runs torch as the commands do (tcmalloc where installed,
   :mod:`seg_at_scale.cli.malloc`, and huge pages for its tensors under glibc's malloc,
   :mod:`seg_at_scale.cli`), so the in-memory network is as fast here as inside
   ``seg-predict``.
3. ``vrt``: the near-free U-Net's ``seg-predict`` of the scene given as a VRT mosaic of
   4 x 4 GeoTIFF pieces (read through GDAL, :class:`~seg_at_scale.io.raster.GdalReader`)
   against the scene's own TIFF (the project's reader), the same labels checked.

Each ``seg-predict`` prints its own split (read, model, write, finalize seconds); the
medians go into the JSON with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import as_commands  # noqa: F401 - before torch: tcmalloc (or huge pages), as the commands run

# isort: split
import torch
from common import fake_run, save, synthetic_scene

from seg_at_scale.data.windows import RasterWindows
from seg_at_scale.io import RasterReader
from seg_at_scale.models.trained import load_run
from seg_at_scale.prediction.layout_choice import with_layout
from seg_at_scale.prediction.options import PredictOptions
from seg_at_scale.prediction.plan import with_tile
from seg_at_scale.prediction.scene import predict_scene
from seg_at_scale.tiling import fill_of, make_grid

DATA = Path(__file__).resolve().parents[1] / "data" / "bench" / "feed"


def scene(size: int) -> Path:
    return synthetic_scene(DATA, size, compression="zlib")


def predict(run: Path, image: Path, out: Path, tile: int | None = None) -> dict[str, Any]:
    """``seg-predict`` as a user runs it; wall time and its own split."""
    for p in out.parent.glob(out.stem + "*"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    cmd = [sys.executable, "-m", "seg_at_scale.cli.predict", f"run={run}", f"image={image}",
           f"output={out}", "preview=false", "progress=false", "fast=true",
           f"hydra.run.dir={out.parent / 'hydra'}"]
    if tile is not None:
        cmd.append(f"tile_size={tile}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "CI": "true"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"seg-predict failed: {proc.stderr[-2000:]}")
    res = json.loads(proc.stdout[proc.stdout.index("{"):])
    return {"wall_s": round(wall, 2), **{k: round(res[k], 2) for k in (
        "seconds", "read_s", "read_wait_s", "model_s", "write_s", "finalize_s") if k in res}}


def mosaic_of(image: Path, pieces: int = 4) -> Path:
    """The scene as a VRT over ``pieces`` x ``pieces`` GeoTIFFs (256^2 DEFLATE tiles, as
    the scene), written once beside it."""
    import rasterio
    from rasterio.windows import Window as GdalWindow

    from seg_at_scale.io.vrt import write_vrt

    folder = image.with_name(f"{image.stem}_pieces")
    vrt = folder / "mosaic.vrt"
    if vrt.exists():
        return vrt
    folder.mkdir(exist_ok=True)
    paths = []
    with rasterio.open(image) as src:
        step = -(-src.height // pieces)
        for i in range(0, src.height, step):
            for j in range(0, src.width, step):
                w = GdalWindow(j, i, min(step, src.width - j), min(step, src.height - i))
                profile = {**src.profile, "width": w.width, "height": w.height,
                           "transform": src.window_transform(w), "tiled": True,
                           "blockxsize": 256, "blockysize": 256, "compress": "deflate"}
                paths.append(folder / f"p{i}_{j}.tif")
                with rasterio.open(paths[-1], "w", **profile) as dst:
                    dst.write(src.read(window=w))
    return write_vrt(paths, vrt)


def gdal_cog(image: Path, out: Path) -> float:
    """GDAL's COG copy of the scene (DEFLATE, all cores); seconds."""
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    subprocess.run(["gdal_translate", "-q", "-of", "COG", "-co", "COMPRESS=DEFLATE",
                    "-co", "NUM_THREADS=ALL_CPUS", str(image), str(out)], check=True)
    return time.perf_counter() - t0


def read_labels(path: Path) -> bytes:
    from seg_at_scale.io import read_raster

    return read_raster(path).tobytes()


def bare_case(run: Path, image: Path) -> tuple[Any, Any, list[torch.Tensor], PredictOptions]:
    """The run's network (fast path), the grid ``tile_size=auto`` gives, its normalised
    tiles in memory and the resolved options."""
    trained = load_run(run)
    options = PredictOptions(fast=True, preview=False, stac=False, progress=False)
    options = with_layout(options, trained.model.eval(), trained.bands)  # as seg-predict
    fmt = torch.channels_last if options.channels_last else torch.contiguous_format
    net = trained.model.to(memory_format=fmt).eval()
    with RasterReader(image) as reader:
        options = with_tile(options, net, trained.footprint, reader.bands, reader.height,
                            reader.width)
        grid = make_grid(reader.height, reader.width, trained.footprint,
                         tile_size=options.tile_size, uniform=True)
        src = RasterWindows(reader, trained.normalizer, fill_of(grid.footprint))
        inputs = [torch.from_numpy(src.read(t.read)[0])[None].contiguous(memory_format=fmt)
                  for t in grid.tiles]
    return net, grid, inputs, options


def bare_seconds(net: Any, grid: Any, inputs: list[torch.Tensor],
                 autocast: torch.dtype | None) -> tuple[float, float]:
    """The network alone on the in-memory tiles, in the prediction's precision: cores
    cropped, labels made as the prediction makes them (argmax in NHWC, uint8). Wall and CPU
    seconds (all threads)."""
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode(), torch.autocast("cpu", dtype=autocast or torch.float32,
                                                enabled=autocast is not None):
        for t, x in zip(grid.tiles, inputs, strict=True):
            c = t.crop
            y = net(x)[:, :, c.row : c.row_end, c.col : c.col_end]
            y.contiguous(memory_format=torch.channels_last).argmax(1).to(torch.uint8).numpy()
    return time.perf_counter() - t0, time.process_time() - c0


def library_seconds(run: Path, image: Path, out: Path,
                    options: PredictOptions) -> tuple[float, float]:
    """``predict_scene`` in this process: the file read, the network, the COG written.
    Wall and CPU seconds (all threads: the reader, the chunk writer, GDAL's)."""
    for p in out.parent.glob(out.stem + "*"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    trained = load_run(run)
    t0, c0 = time.perf_counter(), time.process_time()
    predict_scene(trained, image, out, options)
    return time.perf_counter() - t0, time.process_time() - c0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1536 px, one alternation (smoke)")
    p.add_argument("--size", type=int, default=0, help="scene side (default 8192)")
    p.add_argument("--repeats", type=int, default=0, help="alternations (default 3)")
    p.add_argument("--skip", default="",
                   help="comma list of comparisons to skip: gdal,bare,vrt")
    p.add_argument("--out", default="", help="result JSON (default results/bench_feed.json)")
    args = p.parse_args(argv)
    size = args.size or (1536 if args.quick else 8192)
    repeats = args.repeats or (1 if args.quick else 3)
    skip = set(filter(None, args.skip.split(",")))
    if shutil.which("gdal_translate") is None and "gdal" not in skip:
        sys.exit("gdal_translate not found: apt-get install gdal-bin, or --skip gdal")
    image = scene(size)
    work = DATA / "out"
    work.mkdir(parents=True, exist_ok=True)
    load = [list(os.getloadavg())]
    figures: dict[str, Any] = {"size": size, "repeats": repeats, "torch_threads":
                               torch.get_num_threads()}
    if "gdal" not in skip:
        tiny = fake_run(DATA / "tiny_unet_run", levels=2, base_width=2)
        predict(tiny, image, work / "tiny.tif")  # once per machine: layout=auto's timing
        ours, gdal = [], []
        for _ in range(repeats):
            ours.append(predict(tiny, image, work / "tiny.tif"))
            gdal.append(round(gdal_cog(image, work / "gdal.tif"), 2))
        ours_s = statistics.median(r["wall_s"] for r in ours)
        figures["gdal"] = {
            "what": "seg-predict (U-Net 2 levels x width 2, fast) vs gdal_translate -of COG "
                    "DEFLATE ALL_CPUS, same scene, alternated",
            "ours": ours, "gdal_s": gdal, "ours_median_s": ours_s,
            "gdal_median_s": statistics.median(gdal),
            "gdal_over_ours": round(statistics.median(gdal) / ours_s, 3),
            "gdal_over_ours_fastest": round(min(gdal) / min(r["wall_s"] for r in ours), 3)}
        load.append(list(os.getloadavg()))
    if "bare" not in skip:
        demo = fake_run(DATA / "demo_unet_run")
        predict(demo, image, work / "demo.tif")  # once per machine: layout=auto's timing
        net, grid, inputs, options = bare_case(demo, image)
        bare_seconds(net, grid, inputs, options.autocast)  # oneDNN's kernels, once per size
        bares, library, command, bare_cpu, library_cpu = [], [], [], [], []
        for _ in range(repeats):
            wall, cpu = bare_seconds(net, grid, inputs, options.autocast)
            bares.append(round(wall, 2))
            bare_cpu.append(round(cpu, 2))
            wall, cpu = library_seconds(demo, image, work / "lib.tif", options)
            library.append(round(wall, 2))
            library_cpu.append(round(cpu, 2))
            command.append(predict(demo, image, work / "demo.tif"))
        bare_s = min(bares)  # the least disturbed run of each: the cores are shared
        figures["bare"] = {
            "what": "the demo U-Net (fast, tile_size=auto) on the scene: predict_scene in "
                    "process (file -> COG) and seg-predict (whole command) vs the same "
                    "network on the same tiles in memory (the commands' malloc and huge "
                    "pages in both), alternated; ratios of the fastest",
            "tile_size": options.tile_size, "tiles": len(grid),
            "precision": str(options.autocast or torch.float32), "bare_s": bares,
            "library_s": library, "command": command,
            "library_over_bare": round(bare_s / min(library), 3),
            # each alternation's own pair (run back to back): the drift of the shared cores
            # between alternations cancels, where the fastest of each may come from two
            "library_over_bare_pairs_median": round(statistics.median(
                b / lib for b, lib in zip(bares, library, strict=True)), 3),
            # CPU seconds of all threads: what the file path adds to the network (reading,
            # normalising, labels, chunks, the COG). Where the network already fills every
            # core, library_over_bare cannot pass about bare_cpu / library_cpu
            "bare_cpu_s": bare_cpu, "library_cpu_s": library_cpu,
            "cpu_bound": round(min(bare_cpu) / min(library_cpu), 3),
            "command_over_bare": round(bare_s / min(r["wall_s"] for r in command), 3),
            # the command's tile loop alone (reading, normalising, network, labels, writing)
            "loop_over_bare": round(bare_s / min(r["model_s"] for r in command), 3)}
        del inputs
        load.append(list(os.getloadavg()))
    if "vrt" not in skip:
        tiny = fake_run(DATA / "tiny_unet_run", levels=2, base_width=2)
        mosaic = mosaic_of(image)
        tif_runs, vrt_runs = [], []
        for _ in range(repeats):
            tif_runs.append(predict(tiny, image, work / "tif.tif"))
            vrt_runs.append(predict(tiny, mosaic, work / "vrt.tif"))
        same = read_labels(work / "tif.tif") == read_labels(work / "vrt.tif")
        figures["vrt"] = {
            "what": "seg-predict (U-Net 2 levels x width 2, fast) of the scene as a VRT of "
                    "4 x 4 GeoTIFF pieces (GDAL) vs the scene's TIFF, alternated",
            "tif": tif_runs, "vrt": vrt_runs, "same_labels": same,
            "tif_over_vrt": round(statistics.median(r["wall_s"] for r in tif_runs)
                                  / statistics.median(r["wall_s"] for r in vrt_runs), 3),
            "read_tif_over_vrt": round(statistics.median(r["read_s"] for r in tif_runs)
                                       / statistics.median(r["read_s"] for r in vrt_runs), 3)}
        load.append(list(os.getloadavg()))
    figures["load_avg"] = load
    save("bench_feed", figures, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
