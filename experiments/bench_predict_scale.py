"""Prediction at scale on this machine: 1 process x 2 threads vs 2 processes x 1 thread,
resume cost, streaming efficiency, and a projection to more ranks.

    .venv/bin/python experiments/bench_predict_scale.py --run runs/same_unet_small/<date>  # 20000^2
    .venv/bin/python experiments/bench_predict_scale.py --quick                         # 3000^2

Everything is ``seg-predict`` as a user runs it (a subprocess, fast path: bf16 autocast +
channels_last, output a Cloud-Optimized GeoTIFF), on the synthetic 4-band scene written
once under ``data/bench/predict_scale/``. In one run, so the ratios compare like with like
on the shared cores:

1. bare: the model alone on in-memory, already normalised tiles of the same grid (the
   first grid rows), core pixels per second: what streaming is measured against; measured
   before and after the command-line runs, the mean is the baseline; and, alternated with
   it 3 times in one process on the same tiles, the engine streaming them from the file
   (``engine_vs_bare_alternated``: the streaming cost without the drift between runs);
2. one: ``processes=1`` (2 torch threads); wall time, Mpix/s, peak RSS;
3. two: ``processes=2`` (1 thread each, Lightning Fabric's DDP launch over gloo); peak RSS
   per process; the COG must be byte-identical to one's;
4. resume: ``processes=1`` killed (SIGKILL) once half of the tiles are on disk, then rerun:
   (time to the kill + rerun) / one;
5. projection: with the measured per-tile model time spread over N ranks and the serial
   COG finalisation on rank 0, the wall time of N = 8 (4 nodes x 2 GPUs at this speed).

Without ``--run`` the demo's small U-Net (levels 4, base width 16) with random weights is
used; the throughput is the same, the output compresses better than a trained model's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import torch
from common import add_harness_args, fake_run, save, synthetic_scene

from seg_at_scale.data.windows import RasterWindows
from seg_at_scale.io import RasterReader
from seg_at_scale.models.trained import load_run
from seg_at_scale.tiling import fill_of, footprint, make_grid
from seg_at_scale.tiling.engine import plan_batches, run_batches

DATA = Path(__file__).resolve().parents[1] / "data" / "bench" / "predict_scale"


def scene(size: int) -> Path:
    return synthetic_scene(DATA, size, compression=None)


@contextlib.contextmanager
def first_rows(run: Path, image: Path, tile: int, rows: int) -> Iterator[SimpleNamespace]:
    """The run's network (fast path layout), the file's grid, its first ``rows`` grid rows
    of tiles, their normalised inputs in memory, and the open file's windows."""
    trained = load_run(run)
    net = trained.model.to(memory_format=torch.channels_last)
    with RasterReader(image) as reader:
        grid = make_grid(reader.height, reader.width, footprint(net), tile_size=tile,
                         uniform=True)
        src = RasterWindows(reader, trained.normalizer, fill_of(grid.footprint))
        tiles = grid.tiles[: rows * grid.shape[1]]
        inputs = [torch.from_numpy(src.read(t.read)[0])[None].contiguous(
            memory_format=torch.channels_last) for t in tiles]
        yield SimpleNamespace(net=net, grid=grid, src=src, tiles=tiles, inputs=inputs)


def labels(y: torch.Tensor) -> None:
    """Labels as the prediction writes them (argmax in NHWC, uint8, numpy)."""
    y.contiguous(memory_format=torch.channels_last).argmax(1).to(torch.uint8).numpy()


def bare_seconds(case: SimpleNamespace) -> float:
    """The model alone on the in-memory inputs, cores cropped, labels made."""
    t0 = time.perf_counter()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        for t, x in zip(case.tiles, case.inputs, strict=True):
            c = t.crop
            labels(case.net(x)[:, :, c.row : c.row_end, c.col : c.col_end])
    return time.perf_counter() - t0


def bare(run: Path, image: Path, tile: int, rows: int) -> dict[str, Any]:
    """The model alone on in-memory normalised tiles of the first grid rows (fast path)."""
    with first_rows(run, image, tile, rows) as case:
        bare_seconds(case)  # warm-up: oneDNN makes its kernels once per input size
        seconds = bare_seconds(case)
    tiles, grid = case.tiles, case.grid
    core = sum(t.core.area for t in tiles)
    return {"tiles": len(tiles), "seconds": round(seconds, 2),
            "mpix_per_s": round(core / 1e6 / seconds, 3),
            "s_per_tile": round(seconds / len(tiles), 3), "grid": list(grid.shape),
            "efficiency": round(grid.efficiency, 4)}


def interleaved(run: Path, image: Path, tile: int, rows: int, repeats: int = 3
                ) -> dict[str, Any]:
    """The engine reading the file vs the bare model, alternated in one process.

    The same tiles (the first grid rows), the same fast path, labels made the same way:
    the bare model on in-memory normalised inputs, then ``run_batches`` streaming them from
    the file (reader thread, normalisation on the model's thread). Alternating ``repeats``
    times cancels the drift of the shared cores that separate runs suffer.
    """
    with first_rows(run, image, tile, rows) as case:
        grid = case.grid

        def engine_once() -> float:
            t0 = time.perf_counter()
            for res in run_batches(case.net, case.src, plan_batches(case.tiles, 1),
                                   height=grid.height, width=grid.width, fp=grid.footprint,
                                   device=torch.device("cpu"), autocast=torch.bfloat16,
                                   channels_last=True):
                for y in res.outputs:
                    labels(y[None])
            return time.perf_counter() - t0

        bare_seconds(case)  # warm-up: oneDNN makes its kernels once per input size
        bare_s, engine_s = [], []
        for _ in range(repeats):
            bare_s.append(round(bare_seconds(case), 2))
            engine_s.append(round(engine_once(), 2))
    return {"tiles": len(case.tiles), "bare_s": bare_s, "engine_s": engine_s,
            "engine_vs_bare": round(sum(bare_s) / sum(engine_s), 3)}


def cli(run: Path, image: Path, out: Path, tile: int, processes: int,
        kill_at: float | None = None) -> dict[str, Any]:
    """``seg-predict`` in a subprocess; wall time and peak RSS per process (sampled)."""
    cmd = [sys.executable, "-m", "seg_at_scale.cli.predict", f"run={run}", f"image={image}",
           f"output={out}", f"tile_size={tile}", f"processes={processes}", "preview=false",
           "progress=false", "fast=true", f"hydra.run.dir={out.parent / 'hydra'}"]
    env = {**os.environ, "CI": "true"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    peaks: dict[int, int] = {}
    store, total = out.with_name(f".{out.name}.zarr"), None
    while proc.poll() is None:
        try:
            family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]
            for p in family:
                peaks[p.pid] = max(peaks.get(p.pid, 0), p.memory_info().rss)
        except psutil.Error:
            pass
        if kill_at is not None:
            total = total or _tiles(store)
            if total and _chunks(store) >= kill_at * total:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return {"killed_after_s": round(time.perf_counter() - t0, 1),
                        "chunks_on_disk": _chunks(store), "tiles": total}
        time.sleep(0.2)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"seg-predict failed: {stderr[-2000:]}")
    res = json.loads(stdout[stdout.index("{"):])
    rss = sorted((v for v in peaks.values() if v > 200 << 20), reverse=True)[:processes]
    return {"wall_s": round(wall, 1), "seconds_inside": res["seconds"],
            "mpix_per_s": round(_pixels(image) / 1e6 / wall, 3),
            "peak_rss_mib_per_process": [round(v / 2**20) for v in rss],
            **{k: res[k] for k in ("tiles", "tiles_computed", "tiles_resumed", "model_s",
                                   "read_s", "write_s", "finalize_s")}}


def _pixels(image: Path) -> int:
    with RasterReader(image) as r:
        return r.height * r.width


def _tiles(store: Path) -> int | None:
    meta = store / "labels" / "zarr.json"
    if not meta.exists():
        return None
    doc = json.loads(meta.read_text())
    (h, w), (ch, cw) = doc["shape"], doc["chunk_grid"]["configuration"]["chunk_shape"]
    return -(-h // ch) * -(-w // cw)


def _chunks(store: Path) -> int:
    folder = store / "labels" / "c"
    return sum(1 for p in folder.rglob("*") if p.is_file() and "." not in p.name) \
        if folder.exists() else 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=20000)
    p.add_argument("--tile", type=int, default=1024)
    p.add_argument("--run", default="", help="a trained run folder (the demo's)")
    add_harness_args(p, "2048 px scene, tile 512")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.tile = 2048, 512
    load0 = os.getloadavg()
    image = scene(args.size)
    run = Path(args.run) if args.run else fake_run(DATA / "small_unet_run")
    work = DATA / "out"
    work.mkdir(parents=True, exist_ok=True)
    base = bare(run, image, args.tile, rows=1 if args.quick else 2)
    print("bare", base, flush=True)
    alternated = interleaved(run, image, args.tile, rows=1 if args.quick else 2)
    print("engine vs bare, alternated", alternated, flush=True)
    one = cli(run, image, work / "one.tif", args.tile, 1)
    print("one", one, flush=True)
    two = cli(run, image, work / "two.tif", args.tile, 2)
    print("two", two, flush=True)
    after = bare(run, image, args.tile, rows=1 if args.quick else 2)  # the shared cores drift:
    print("bare after", after, flush=True)  # the baseline is the mean of before and after
    bare_mpix = (base["mpix_per_s"] + after["mpix_per_s"]) / 2
    identical = (work / "one.tif").read_bytes() == (work / "two.tif").read_bytes()
    killed = cli(run, image, work / "resumed.tif", args.tile, 1, kill_at=0.5)
    rerun = cli(run, image, work / "resumed.tif", args.tile, 1)
    resumed_identical = (work / "one.tif").read_bytes() == (work / "resumed.tif").read_bytes()
    per_tile = one["model_s"] / one["tiles"]
    serial = one["finalize_s"]
    projection = {n: round(one["tiles"] * per_tile / n + serial, 1) for n in (1, 2, 8, 32)}
    figures = {
        "size": args.size, "tile_size": args.tile, "run": str(run),
        "bare_model": base, "bare_model_after": after,
        "engine_vs_bare_alternated": alternated, "bare_mpix_per_s_mean": round(bare_mpix, 3),
        "one_process_2_threads": one, "two_processes_1_thread": two,
        "two_vs_one_throughput": round(one["wall_s"] / two["wall_s"], 3),
        "outputs_identical": identical,
        "streaming_efficiency": round(one["mpix_per_s"] / bare_mpix, 3),
        "streaming_efficiency_inside": round(_pixels(image) / 1e6 / one["seconds_inside"]
                                             / bare_mpix, 3),
        "resume": {"killed": killed, "rerun": rerun,
                   "total_vs_uninterrupted": round(
                       (killed["killed_after_s"] + rerun["wall_s"]) / one["wall_s"], 3),
                   "identical": resumed_identical},
        "projection_wall_s_by_ranks": projection,
        "projection_note": "ranks as fast as this CPU process; model time split evenly, COG "
                           "finalisation serial on rank 0 (caps the speed-up at "
                           f"{round((one['tiles'] * per_tile + serial) / max(serial, 1e-9), 1)}x)",
        "load_avg_start_end": [load0, os.getloadavg()],
    }
    save("bench_predict_scale", figures, args.out)
    for f in work.glob("*"):
        if f.is_file():
            f.unlink()
    print(json.dumps({k: figures[k] for k in ("two_vs_one_throughput", "outputs_identical",
                                              "streaming_efficiency")}))


if __name__ == "__main__":
    main()
