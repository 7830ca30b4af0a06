"""The GPU figures: one script, one JSON (``experiments/results/bench_gpu*.json``).

    python experiments/bench_gpu.py                          # a CUDA device, full sizes
    python experiments/bench_gpu.py --sections largest_tile,offload_cost
    python experiments/bench_gpu.py --device cpu --quick     # harness check on a CPU, minutes
    make gpu-check    # on a lent GPU: make test-gpu, then prediction / encoders / training

Sections (each catches its own exception and records its text, so a GPU run gives every
figure it can; an out-of-memory step is a figure, ``fits: false``):

* ``matmul_peak``: best ``a @ b`` TFLOP/s in fp32 (TF32 off), TF32 and bf16;
* ``unet_forward``: the U-Net forward (``conf/model/unet_*``: small, medium, large) in TFLOP/s
  and as a fraction of the matching matmul peak, eager and ``torch.compile``;
* ``prediction``: the streaming predictor (``predict_raster``, bf16 + channels_last, on the
  synthetic scene) vs the bare model on device-resident tiles: the gap is I/O and copies;
  ``io_alone``: the reads and the COG with no network; ``profile``: one run under
  ``torch.profiler`` (how busy the device was, the costliest operators); ``archive``: the
  same pixels as 16 scenes of a quarter side in one archive against the scene alone
  (whether the device idles between scenes);
* ``train_step``: the exact whole-image step on 4096^2 and 8192^2, tiled vs untiled;
* ``largest_tile``: the largest trainable tile per memory mode within 90 % of the
  device's memory (``find_largest_tile``), time per pixel vs ``none``;
* ``offload_cost``: offload vs none at one tile, and the pinned host link's GB/s;
* ``ibm_gscnn``: Gated-SCNN (wide) on 800^2 crops, batch 16, per memory mode;
* ``encoders``: Unet-ResNet34 and DeepLabV3+-ResNet50 (smp) on a device-resident 8192^2
  scene: untiled, exact tiles fp32 / bf16, MONAI's sliding window (``gpu_encoders.py``);
* ``pipeline``: fairscale Pipe with one stage vs the plain model (torchgpipe: 0.858x), and
  the planner's predicted step vs the measured one for 1 and 2 stages on the device.

Without a CUDA device it prints ``skipped: needs CUDA ...``, writes nothing and exits 0
(``--device cpu --quick`` runs every section on tiny sizes on the CPU: the harness
check). After each
section the figures so far are in ``<out>.partial.json`` (removed when the run completes).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from common import RESULTS, add_harness_args, machine, save, skip, synthetic_scene
from gpu_common import (
    Sizes,
    attempt,
    fresh,
    precision,
    run_section,
    sizes_for,
    timed,
    unet_from_conf,
)
from torch.utils.flop_counter import FlopCounterMode

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.io import RasterReader, read_raster
from seg_at_scale.io.cog import class_colors, write_cog
from seg_at_scale.memory import GIB
from seg_at_scale.parallel.pipe import PipelineConfig, build_pipe, close_pipe
from seg_at_scale.parallel.planner import balance_by, predict
from seg_at_scale.parallel.profile import profile_layers
from seg_at_scale.prediction import PredictOptions, predict_raster
from seg_at_scale.prediction.plan import with_tile
from seg_at_scale.tiling import make_grid

# the test files that hold the CUDA tests (``make test-gpu``): collected alone, so a machine
# that lacks a package only the CPU suite needs (geopandas, optuna) still runs them all
GPU_TESTS = ("tests/test_gpu.py", "tests/models/test_smp_gpu.py")
TIMES = ("total_s", "model_s", "read_s", "write_s", "finalize_s")  # PredictionStats fields
SEEDS = {"torchgpipe_pipeline_1_vs_plain": 0.858, "ibm_offload_overhead_nvlink": 0.30,
         "ibm_offload_overhead_pcie": 1.06}


def precisions(dev: torch.device) -> tuple[str, ...]:
    return ("fp32", "tf32", "bf16") if dev.type == "cuda" else ("fp32", "bf16")


def matmul_peak(dev: torch.device, sz: Sizes) -> dict[str, Any]:
    """Best square matmul TFLOP/s per precision (TF32: CUDA only)."""
    n = sz.matmul
    out: dict[str, Any] = {"n": n, "unit": "TFLOP/s", "tf32": None}
    for name in precisions(dev):
        dtype = torch.bfloat16 if name == "bf16" else torch.float32
        a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
        with precision("tf32" if name == "tf32" else "fp32", dev):
            times = timed(lambda a=a, b=b: a @ b, dev, max(3, sz.repeats), warmup=2)
        out[name] = round(2 * n**3 / min(times) / 1e12, 4)
    return out


def forward_flops(net: torch.nn.Module, x: torch.Tensor) -> int:
    """FLOPs of one forward pass (2 per multiply-add), counted by ``FlopCounterMode``."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        net(x)
    return int(counter.get_total_flops())


def unet_forward(dev: torch.device, sz: Sizes, peaks: dict[str, Any],
                 backend: str) -> dict[str, Any]:
    """Forward TFLOP/s of each U-Net size, eager and compiled, vs the matmul peak."""
    side, batch = sz.unet_side, sz.unet_batch
    out: dict[str, Any] = {"side": side, "batch": batch, "compile_backend": backend,
                           "models": {}}
    for size in sz.unet_sizes:
        base = fresh(unet_from_conf(size), dev).eval()
        x = torch.randn(batch, 4, side, side, device=dev)
        flops = forward_flops(base, x)
        row: dict[str, Any] = {"gflop_per_mpix": round(flops / (batch * side * side) / 1e3, 2),
                               "params_M": round(sum(p.numel() for p in base.parameters())
                                                 / 1e6, 2)}
        for prec in precisions(dev):
            cl = prec == "bf16"  # the fast path: bf16 autocast + channels_last
            net = fresh(base, dev).to(memory_format=torch.channels_last) if cl else base
            xx = x.contiguous(memory_format=torch.channels_last) if cl else x
            for kind in ("eager", "compiled"):
                if kind == "compiled":  # a clean cache: 3 sizes x layouts would pass the
                    torch.compiler.reset()  # recompile limit and fall back to eager silently
                fn = net if kind == "eager" else torch.compile(net, backend=backend)
                row[f"{prec}_{kind}"] = attempt(
                    lambda fn=fn, xx=xx, prec=prec, flops=flops: _forward_figures(
                        fn, xx, prec, flops, peaks.get(prec), dev, sz.repeats))
        out["models"][size] = row
        print(f"   {size}: " + ", ".join(f"{k} {v.get('tflops')}" for k, v in row.items()
                                         if isinstance(v, dict)) + " TFLOP/s", flush=True)
    return out


def _forward_figures(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, prec: str, flops: int,
                     peak: float | None, dev: torch.device, repeats: int) -> dict[str, Any]:
    """Time one forward configuration; its first call (compilation) is timed apart."""
    with torch.inference_mode(), precision(prec, dev):
        first = timed(lambda: fn(x), dev, 1, warmup=0)[0]
        best = min(timed(lambda: fn(x), dev, repeats, warmup=1))
    tflops = flops / best / 1e12
    return {"s": round(best, 5), "mpix_per_s": round(x.shape[0] * x.shape[-2] * x.shape[-1]
                                                     / 1e6 / best, 3),
            "tflops": round(tflops, 4), "first_call_s": round(first, 2),
            "fraction_of_peak": round(tflops / peak, 4) if peak else None}


def prediction(dev: torch.device, sz: Sizes) -> dict[str, Any]:
    """Streaming file -> file vs the bare model on device-resident tiles (same grid)."""
    net = fresh(unet_from_conf("small"), dev).eval().to(memory_format=torch.channels_last)
    side, tile = sz.raster_side, sz.raster_tile
    grid = make_grid(side, side, net.footprint(), tile_size=tile)
    out: dict[str, Any] = {"model": "small", "side": side, "tile": tile, "tiles": len(grid),
                           "E": round(grid.efficiency, 4), "path": "bf16 + channels_last",
                           "input": "the synthetic 4-band uint8 scene, 256^2 zlib tiles"}
    with tempfile.TemporaryDirectory() as tmp:
        # a scene like imagery (noise neither compresses nor gives a label map like a
        # prediction's, whose compression is most of the COG's finalisation)
        image = synthetic_scene(Path(tmp), side)
        runs = []
        for k in range(2):  # the first run plans the kernels
            stats = predict_raster(net, image, Path(tmp) / f"mask{k}.tif",
                                   PredictOptions(tile_size=tile, fast=True, overwrite=True),
                                   normalizer=Normalizer())
            runs.append(stats)
        # tile_size=auto (the default): the device chooses; a scene that fits is one tile
        auto_opts = with_tile(PredictOptions(fast=True, overwrite=True), net, net.footprint(),
                              4, side, side)
        autos = [predict_raster(net, image, Path(tmp) / f"auto{k}.tif", auto_opts,
                                normalizer=Normalizer()) for k in range(2)]
        out["io_alone"] = attempt(lambda: _io_alone(image, Path(tmp) / "mask1.tif", grid,
                                                    Path(tmp)))
        out["profile"] = attempt(lambda: _profiled(lambda: predict_raster(
            net, image, Path(tmp) / "profiled.tif",
            PredictOptions(tile_size=tile, fast=True, overwrite=True),
            normalizer=Normalizer()), dev))
        out["archive"] = attempt(lambda: _archive_of_small_scenes(dev, side, Path(tmp)))
    best_auto = max(autos, key=lambda s: s.mpix_per_s)
    auto_grid = make_grid(side, side, net.footprint(), tile_size=auto_opts.tile_size,
                          uniform=True)
    auto_bare = attempt(lambda: {"mpix_per_s": _bare_model(net, auto_grid, dev, 1,
                                                           sz.repeats)})
    out["auto"] = {"tile_size": auto_opts.tile_size, "tiles": best_auto.tiles,
                   "untiled": best_auto.tiles == 1,
                   "mpix_per_s": round(best_auto.mpix_per_s, 3), "bare": auto_bare,
                   "first_total_s": round(autos[0].total_s, 3),
                   **{k: round(getattr(best_auto, k), 3) for k in TIMES
                      if hasattr(best_auto, k)}}
    if auto_bare.get("mpix_per_s"):
        out["auto"]["streaming_vs_bare"] = round(best_auto.mpix_per_s
                                                 / auto_bare["mpix_per_s"], 4)
    best = max(runs, key=lambda s: s.mpix_per_s)
    out["streaming"] = {"mpix_per_s": round(best.mpix_per_s, 3),
                        **{k: round(getattr(best, k), 3) for k in TIMES if hasattr(best, k)},
                        # the first run in the process: its kernels planned, as a user's
                        # one-scene seg-predict runs
                        "first_total_s": round(runs[0].total_s, 3)}
    batched = 1 if dev.type != "cuda" else max(1, min(16, (16 << 20) // (tile * tile)))
    for batch in sorted({1, batched}):  # the predictor batches ~16 Mpix of input on a GPU
        out[f"bare_batch{batch}"] = attempt(lambda batch=batch: {
            "mpix_per_s": _bare_model(net, grid, dev, batch, sz.repeats)})
    bare = max(v.get("mpix_per_s", 0) for k, v in out.items() if k.startswith("bare"))
    out["streaming_vs_bare"] = round(out["streaming"]["mpix_per_s"] / bare, 4) if bare else None
    return out


def _profiled(run: Callable[[], Any], dev: torch.device, top: int = 12) -> dict[str, Any]:
    """One run under ``torch.profiler``: how busy the device was over the wall time (the
    kernels' time over the run's), and the operators that took the most host and device
    time: where the file path leaves the device idle."""
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        run()
        if cuda:
            torch.cuda.synchronize(dev)
    wall = time.perf_counter() - t0
    events = prof.key_averages()

    def device_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total",
                             getattr(e, "self_cuda_time_total", 0.0)) or 0.0)

    def rows(key: Callable[[Any], float]) -> list[dict[str, Any]]:
        return [{"name": e.key, "calls": e.count,
                 "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2),
                 "self_device_ms": round(device_us(e) / 1e3, 2)}
                for e in sorted(events, key=key, reverse=True)[:top]]

    # the device's own events (kernels, copies): an operator's row repeats its kernels' time
    busy = sum(device_us(e) for e in events
               if str(getattr(e, "device_type", "")).endswith("CUDA")) / 1e6
    return {"wall_s": round(wall, 3), "device_busy_s": round(busy, 3) if cuda else None,
            "device_busy_fraction": round(busy / wall, 4) if cuda else None,
            "top_self_cpu": rows(lambda e: e.self_cpu_time_total),
            **({"top_self_device": rows(device_us)} if cuda else {})}


def _archive_of_small_scenes(dev: torch.device, side: int, tmp: Path,
                             count: int = 16) -> dict[str, Any]:
    """The large scene's pixels as ``count`` scenes of ``side / 4``, one archive, against
    that scene alone, through the command's path (a run folder of the demo's U-Net, fast,
    ``tile_size=auto``, COGs, no preview or STAC), each the best of two: whether the device
    idles between scenes (the archive runs its scenes as one stream of batches)."""
    from common import fake_run

    from seg_at_scale.models.loading import load_trained
    from seg_at_scale.prediction.archive import archive_scenes, predict_archive
    from seg_at_scale.prediction.scene import predict_scene

    trained = load_trained(fake_run(tmp / "run"), ckpt="last")
    trained.model.to(dev)
    small = max(64, side // 4)
    one = synthetic_scene(tmp / "small", small)
    folder = tmp / "archive"
    folder.mkdir()
    for k in range(count):
        os.link(one, folder / f"s{k:02d}.tif")
    large = synthetic_scene(tmp, side)
    opts = PredictOptions(fast=True, overwrite=True, progress=False, preview=False,
                          stac=False, resume=False)
    archive_s, alone_s = [], []
    for k in range(2):
        (tmp / f"out{k}").mkdir()
        t0 = time.perf_counter()
        records = predict_archive(trained, archive_scenes(str(folder), tmp / f"out{k}"), opts)
        archive_s.append(time.perf_counter() - t0)
        assert all(r.status == "done" for r in records), [r.reason for r in records]
        t0 = time.perf_counter()
        predict_scene(trained, large, tmp / f"alone{k}.tif", opts)
        alone_s.append(time.perf_counter() - t0)
    mpix_archive = count * small * small / 1e6 / min(archive_s)
    mpix_alone = side * side / 1e6 / min(alone_s)
    return {"scenes": count, "side": small, "large_side": side,
            "archive_mpix_per_s": round(mpix_archive, 2),
            "alone_mpix_per_s": round(mpix_alone, 2),
            "archive_over_alone": round(mpix_archive / mpix_alone, 4),
            "archive_s": [round(v, 3) for v in archive_s],
            "alone_s": [round(v, 3) for v in alone_s]}


def _io_alone(image: Path, mask: Path, grid: Any, tmp: Path) -> dict[str, Any]:
    """What this machine's cores give the file path with no network: every tile's window
    read (the decoder pool, as the path reads it) and the path's own labels (``mask``)
    written again from memory as a COG (the writer and finalisation), each the best of two.
    """
    reads, writes = [], []
    labels = read_raster(mask)
    for k in range(2):
        t0 = time.perf_counter()
        with RasterReader(image) as reader:
            for tile in grid.tiles:
                reader.read(tile.read)
        reads.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        write_cog(tmp / f"labels{k}.tif", labels.shape, "uint8",
                  (labels[:, r:r + 1024] for r in range(0, grid.height, 1024)),
                  nodata=255, colormap=class_colors(5), overwrite=True)
        writes.append(time.perf_counter() - t0)
    mpix = grid.height * grid.width / 1e6
    return {"read_s": round(min(reads), 3), "read_mpix_per_s": round(mpix / min(reads), 1),
            "write_cog_s": round(min(writes), 3),
            "write_cog_mpix_per_s": round(mpix / min(writes), 1),
            "threads": len(os.sched_getaffinity(0))}


def _bare_model(net: torch.nn.Module, grid: Any, dev: torch.device, batch: int,
                repeats: int) -> float:
    """Output Mpix/s of the model alone on the grid's tiles, inputs already on the device."""
    shapes = Counter((t.read.height, t.read.width) for t in grid.tiles)
    inputs = {s: torch.randn(batch, 4, *s, device=dev).contiguous(
        memory_format=torch.channels_last) for s in shapes}

    def run() -> None:
        for s, n in shapes.items():
            for k in range(0, n, batch):
                net(inputs[s][: min(batch, n - k)]).argmax(1)

    with torch.inference_mode(), torch.autocast(dev.type, dtype=torch.bfloat16):
        best = min(timed(run, dev, max(1, repeats), warmup=1))
    return round(grid.height * grid.width / 1e6 / best, 3)


def pipeline(dev: torch.device, sz: Sizes) -> dict[str, Any]:
    """Pipe with one stage vs the plain model; planner predicted vs measured (k = 1, 2)."""
    net = fresh(unet_from_conf("small"), dev)
    n, m, b, t = len(net.pipeline_layers()), sz.pipe_chunks, sz.pipe_batch, sz.pipe_tile
    x = torch.randn(b, 4, t, t, device=dev)
    reps = max(2, sz.repeats)

    def step_s(fn: Callable[[torch.Tensor], torch.Tensor]) -> float:
        return min(timed(lambda: fn(x).float().pow(2).mean().backward(), dev, reps))

    plain = step_s(net)
    out: dict[str, Any] = {"model": "small", "batch": b, "tile": t, "layers": n,
                           "plain_step_s": round(plain, 4), "pipeline_1": {}, "planner": {}}
    def piped(cfg: PipelineConfig) -> float:
        pipe = build_pipe(net, cfg)
        try:
            return step_s(pipe)
        finally:
            close_pipe(pipe)

    def one_stage(chunks: int, ck: str) -> dict[str, Any]:
        s = piped(PipelineConfig([n], [str(dev)], chunks, ck))
        return {"step_s": round(s, 4), "speed_vs_plain": round(plain / s, 4)}

    for chunks, ck in ((1, "never"), (m, "never"), (m, "except_last")):
        out["pipeline_1"][f"m{chunks}_{ck}"] = attempt(lambda c=chunks, k=ck: one_stage(c, k))
    costs = profile_layers(net.pipeline_layers(), x[: b // m], repeats=reps)

    def planned(k: int) -> dict[str, Any]:
        bal = balance_by(costs, k, "time")
        pred = predict(costs, bal, [str(dev)] * k, m, "except_last", b, profiled_batch=b // m)
        s = piped(PipelineConfig(bal, [str(dev)] * k, m, "except_last"))
        return {"balance": bal, "predicted_s": round(pred.step_s, 4), "measured_s": round(s, 4),
                "ratio": round(pred.step_s / s, 4)}

    for k in (1, 2):
        out["planner"][f"k{k}"] = attempt(lambda k=k: planned(k))
    out["goals"] = {"pipeline_1 speed_vs_plain": "> 0.858 (torchgpipe)",
                    "planner ratio": "within 20 %"}
    return out


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def header(dev: torch.device) -> dict[str, Any]:
    """The device table: name and memory, torch / CUDA / cuDNN versions, TF32 defaults."""
    h: dict[str, Any] = {"type": dev.type, "torch": torch.__version__,
                         "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                         "tf32_default": {"matmul": torch.backends.cuda.matmul.allow_tf32,
                                          "cudnn": torch.backends.cudnn.allow_tf32},
                         "loadavg_start": list(os.getloadavg()),
                         # without imagecodecs tifffile inflates DEFLATE with zlib (slower)
                         "imagecodecs": _version("imagecodecs")}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        h.update(name=p.name, memory_gib=round(p.total_memory / GIB, 2),
                 capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                 count=torch.cuda.device_count())
    else:
        h.update(name=machine()["cpu"],
                 threads=torch.get_num_threads())
    return h


def gpu_tests(timeout: int, log: Path) -> dict[str, Any]:
    """``pytest -m gpu`` on :data:`GPU_TESTS`: its closing line, status and time; its whole
    output (the tracebacks of what failed) in ``log``."""
    import subprocess
    import sys

    t0 = time.perf_counter()
    cores = os.cpu_count() or 1
    workers = ["-n", "4"] if cores > 4 else []  # a GPU machine's cores: 4 tests at a time
    try:
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu",
                              "-p", "no:cacheprovider", *workers, *GPU_TESTS],
                             cwd=Path(__file__).resolve().parents[1],
                             capture_output=True, text=True, timeout=timeout)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(out.stdout + out.stderr)
        lines = out.stdout.strip().splitlines()
        result = {"returncode": out.returncode, "summary": lines[-1] if lines else "",
                  "failed": [ln for ln in lines if ln.startswith("FAILED")][:20]}
    except subprocess.TimeoutExpired as e:
        done = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        log.write_text(done)
        result = {"returncode": None, "summary": f"stopped after {timeout} s"}
    print(f"make test-gpu: {result['summary']}", flush=True)
    return {**result, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", help="auto | cuda | cuda:<i> | cpu")
    ap.add_argument("--sections", default=None, help="comma-separated subset")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend (default inductor; aot_eager with --quick on "
                         "a CPU, where inductor compiles C++ for ~20 s per model)")
    ap.add_argument("--budget-gib", type=float, default=None, help="largest_tile budget")
    ap.add_argument("--threads", type=int, default=None)
    add_harness_args(ap, "tiny sizes (with --device cpu: the harness check on a CPU)")
    ap.add_argument("--tests", action="store_true",
                    help="first run `pytest -m gpu` (make test-gpu) and record its summary in "
                         "the same JSON (make gpu-check)")
    ap.add_argument("--tests-timeout", type=int, default=240, help="seconds for --tests")
    args = ap.parse_args(argv)
    if args.device == "auto" and not torch.cuda.is_available():
        skip("needs CUDA (bench_gpu: no CUDA device here; `--device cpu --quick` checks the "
             "harness on this CPU in a few minutes)")
        return
    out_path = args.out or RESULTS / "bench_gpu.json"
    tests = gpu_tests(args.tests_timeout, out_path.with_suffix(".tests.log")) \
        if args.tests else None
    dev = torch.device("cuda" if args.device == "auto" else args.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda" and not args.quick:
        skip("needs CUDA (bench_gpu: --device cpu runs with --quick only: the harness check)")
        return
    # the sections that import smp, timm and the training stack (2 s): after the checks
    from gpu_encoders import encoders
    from gpu_training import ibm_gscnn, largest_tile, offload_cost, train_step

    threads = args.threads or (1 if dev.type == "cpu" else None)  # shared cores: no spinning
    if threads:
        torch.set_num_threads(threads)
    sz = sizes_for(args.quick, budget_gib=args.budget_gib)
    backend = args.compile_backend or ("aot_eager" if args.quick and dev.type == "cpu"
                                       else "inductor")
    t0, head = time.perf_counter(), header(dev)
    todo: dict[str, Callable[[], dict[str, Any]]] = {
        "matmul_peak": lambda: matmul_peak(dev, sz),
        "unet_forward": lambda: unet_forward(dev, sz, sections.get("matmul_peak", {}), backend),
        "prediction": lambda: prediction(dev, sz),
        "train_step": lambda: train_step(dev, sz),
        "largest_tile": lambda: largest_tile(dev, sz),
        "offload_cost": lambda: offload_cost(dev, sz),
        "ibm_gscnn": lambda: ibm_gscnn(dev, sz),
        "pipeline": lambda: pipeline(dev, sz),
        "encoders": lambda: encoders(dev, sz)}
    chosen = args.sections.split(",") if args.sections else list(todo)
    unknown = sorted(set(chosen) - set(todo))
    if unknown:
        ap.error(f"--sections: unknown {unknown}; choose from {sorted(todo)}")
    sections: dict[str, Any] = {}
    name = "bench_gpu" + ("_cpu" if dev.type == "cpu" else "") + ("_quick" if args.quick else "")
    partial = (args.out or RESULTS / f"{name}.json").with_suffix(".partial.json")
    for section in chosen:
        sections[section] = run_section(section, todo[section], dev)
        # a run stopped at a time limit keeps the sections it finished
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"device": head, "sizes": asdict(sz),
                                       "sections": sections}, indent=2, default=float))
    head["loadavg_end"] = list(os.getloadavg())
    save(name, {"device": head, "quick": args.quick, "sizes": asdict(sz), "seeds": SEEDS,
                "wall_s": round(time.perf_counter() - t0, 1), "sections": sections,
                **({"make_test_gpu": tests} if tests is not None else {})},
         path=args.out)
    partial.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
