"""Shared helpers of the benchmark scripts: machine description, JSON output, peak memory.

Every benchmark prints its figures and saves them as JSON under ``experiments/results/``
together with :func:`machine`, so a number always travels with the machine it came from.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """CPU model, cores, memory, library versions, the malloc this process runs."""
    from seg_at_scale.cli.malloc import allocator

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "allocator": allocator(),
    }


def commit() -> str:
    """The checkout's commit (``+dirty`` when files differ from it), or ``unknown``.

    The benchmarks' own outputs (``experiments/results/``, ``docs/benchmarks.md``) do not
    count: a second benchmark run after a first is still of the same code.
    """
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()
        own = [":(exclude)experiments/results", ":(exclude)docs/benchmarks.md"]
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", *own], cwd=root, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def save(name: str, figures: dict[str, Any], path: Path | None = None) -> Path:
    """Print ``figures`` and write ``results/<name>.json`` (or ``path``).

    Every result carries the one schema ``experiments/report.py`` reads: ``benchmark``,
    ``commit``, ``date``, ``machine`` and ``loadavg_at_save``, then the figures.
    """
    doc = {"benchmark": name, "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M"),
           "machine": machine(), "loadavg_at_save": list(os.getloadavg()), **figures}
    path = path or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=_plain) + "\n")
    print(json.dumps(doc, indent=2, default=_plain))
    print(f"saved {path}")
    return path


def _plain(value: Any) -> Any:
    """JSON for what ``json`` lacks: paths as text, numbers (numpy, tensors) as floats."""
    return str(value) if isinstance(value, Path) else float(value)


def add_harness_args(parser: argparse.ArgumentParser, quick: str) -> argparse.ArgumentParser:
    """``--quick`` (a smoke run of seconds: ``quick`` says what it shrinks) and ``--out``.

    Every benchmark takes both (``experiments/bench.py`` passes them through); the quick run
    takes the same code path and writes the same schema, on tiny sizes.
    """
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {quick}")
    parser.add_argument("--out", type=Path, default=None,
                        help="result JSON (default experiments/results/<name>.json)")
    return parser


def skip(reason: str) -> None:
    """The one line a benchmark prints when this machine cannot run it (it writes nothing)."""
    print(f"skipped: {reason}", flush=True)


def _child(fn: Callable[..., Any], args: tuple, queue: mp.Queue) -> None:
    try:
        queue.put(("ok", fn(*args)))
    except BaseException as e:  # report, don't hang the parent
        queue.put(("error", f"{type(e).__name__}: {e}"))


def run_isolated(fn: Callable[..., Any], *args: Any, poll_s: float = 0.01) -> dict[str, Any]:
    """Run ``fn(*args)`` in a fresh process; return its result and its peak RSS in MiB.

    Peak RSS is sampled from the parent every ``poll_s`` and also read from the child's
    ``ru_maxrss`` equivalent (``psutil``'s ``peak_wset``/``vms`` are not portable), so the
    figure is the larger of the sampled maximum and what the child reports itself.
    ``fn`` must be a module-level function (it is pickled by the ``spawn`` context).
    """
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, args, queue))
    t0 = time.perf_counter()
    proc.start()
    ps = psutil.Process(proc.pid)
    peak = 0
    result = None
    while proc.is_alive() or result is None:
        try:
            peak = max(peak, ps.memory_info().rss)
        except psutil.Error:
            pass
        try:
            result = queue.get(timeout=poll_s)
            break
        except Exception:
            if not proc.is_alive() and queue.empty():
                break
    proc.join()
    status, value = result if result is not None else ("error", f"exit code {proc.exitcode}")
    return {"status": status, "result": value, "peak_rss_mib": peak / 2**20,
            "wall_s": time.perf_counter() - t0}


def run_measured(cmd: list[str], cwd: Path, env: dict[str, str], name: str
                 ) -> tuple[dict[str, float], str]:
    """Run ``cmd`` as a process of its own, output into ``cwd/<name>.out`` and ``.err``: its
    wall seconds, user and system CPU seconds and peak RSS (``wait4``: the process and the
    children it waited for), and its standard output. Raises on a non-zero exit."""
    import subprocess

    logs = cwd / f"{name}.out", cwd / f"{name}.err"
    with open(logs[0], "w") as out_f, open(logs[1], "w") as err_f:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out_f, stderr=err_f)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ({name}) failed: "
                           f"{logs[1].read_text()[-2000:]}")
    return {"wall_s": round(wall, 2), "user_s": round(usage.ru_utime, 2),
            "sys_s": round(usage.ru_stime, 2),
            "peak_rss_mib": round(usage.ru_maxrss / 1024)}, logs[0].read_text()


def labels_equal(a: Path, b: Path) -> bool:
    """Whether two label rasters hold the same values."""
    import rasterio

    with rasterio.open(a) as x, rasterio.open(b) as y:
        return bool((x.read() == y.read()).all())


def peak_rss_self_mib() -> float:
    """This process's peak resident set size so far (Linux ``ru_maxrss``), MiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def random_feature_init(net: nn.Module) -> nn.Module:
    """He-normal weights, zero biases: an untrained net whose labels vary over the image.

    PyTorch's default init shrinks activations layer by layer, so an untrained U-Net's
    logits are the head's bias almost everywhere and its argmax is one class for the whole
    image, which would make every label comparison trivially equal. With variance-keeping
    weights the logits are random features of the image (several classes, small margins).
    """
    for m in net.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            fan = "fan_out" if isinstance(m, nn.ConvTranspose2d) else "fan_in"  # = in x k x k
            nn.init.kaiming_normal_(m.weight, mode=fan, nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    return net


def fake_run(folder: Path, levels: int = 4, base_width: int = 16,
             node: dict[str, Any] | None = None) -> Path:
    """A run folder as seg-train leaves it, holding a network with random weights.

    The default is the demo's small U-Net (levels 4, base width 16); levels 3 / width 8 is
    the tiny one. ``node``: another model config instead (4 bands, 5 classes), e.g. an smp
    network's. Prediction throughput is the same as a trained model's.
    """
    import sys

    from seg_at_scale.models.registry import build_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers.prediction import write_run

    if (folder / "checkpoints" / "last.ckpt").exists():
        return folder
    torch.manual_seed(0)
    node = node or {"_target_": "seg_at_scale.models.UNet", "levels": levels,
                    "convs_per_level": 2, "base_width": base_width, "padding": "same"}
    node = {**node, "in_channels": 4, "num_classes": 5}
    net = build_model(node, where="fake_run").eval()
    data = {"bands": 4, "num_classes": 5, "class_names": None, "ignore_index": 255,
            "nodata": None, "scale": 1 / 255, "mean": [0.5], "std": [0.25]}
    return write_run(folder, node, net, data)


def synthetic_scene(folder: Path, size: int, compression: str | None = "zlib") -> Path:
    """The synthetic 4-band uint8 scene of ``size``^2 in 256^2 tiles, written once."""
    from seg_at_scale.data.sources.synthetic import write_scene
    from seg_at_scale.data.synthetic import SceneGenerator

    image = folder / f"scene{size}.tif"
    if not image.exists():
        folder.mkdir(parents=True, exist_ok=True)
        print(f"generating {image.name} ...", flush=True)
        write_scene(image, image.with_name(image.stem + "_mask.tif"),
                    SceneGenerator(0, size, size), compression=compression, overwrite=True)
    return image
