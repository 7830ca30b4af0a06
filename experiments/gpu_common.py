"""Helpers of ``bench_gpu.py``: sizes, timing with device synchronisation, peak memory.

Peak memory is the CUDA caching allocator's ``max_memory_allocated`` above what was
allocated when the block started (``reset_peak_memory_stats`` first), or on a CPU the
resident set size sampled every millisecond above its start (approximate: glibc keeps and
reuses freed memory, so a repeated step can show less than its first run).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import torch
from omegaconf import OmegaConf

import seg_at_scale
from seg_at_scale.models import UNet

CONF = Path(seg_at_scale.__file__).resolve().parent / "conf"
MIB = 2**20


@dataclass(frozen=True)
class Sizes:
    """What each section runs: the GPU defaults, or :data:`QUICK` for a CPU smoke run."""

    matmul: int = 8192
    repeats: int = 5
    unet_sizes: tuple[str, ...] = ("small", "medium", "large")
    unet_side: int = 1024
    unet_batch: int = 4
    raster_side: int = 8192
    raster_tile: int = 2048
    train_model: str = "small"
    train_sides: tuple[int, ...] = (4096, 8192)
    train_tile: int = 2048
    tile_modes: tuple[str, ...] = ("none", "checkpoint", "checkpoint:strips", "offload",
                                   "checkpoint_offload", "none@bf16-mixed",
                                   "checkpoint:strips@bf16-mixed")
    budget_gib: float | None = None  # None: 90 % of the device's memory
    max_probes: int = 8
    rel_tol: float = 0.05
    max_side: int = 32768
    offload_side: int = 4096
    gscnn_preset: str = "wide"
    gscnn_crop: int = 800
    gscnn_batch: int = 16
    pipe_batch: int = 8
    pipe_tile: int = 512
    pipe_chunks: int = 4
    enc_side: int = 8192
    enc_tile: int = 4096
    enc_repeats: int = 2


QUICK = Sizes(matmul=256, repeats=1, unet_side=32, unet_batch=1, raster_side=256,
              raster_tile=128, train_model="tiny", train_sides=(96, 128), train_tile=96,
              tile_modes=("none", "checkpoint:strips"), budget_gib=48 / 1024, max_probes=3,
              rel_tol=0.2, max_side=256, offload_side=128, gscnn_preset="tiny", gscnn_crop=64,
              gscnn_batch=2, pipe_batch=4, pipe_tile=64, pipe_chunks=2, enc_side=256,
              enc_tile=1728, enc_repeats=1)


def sizes_for(quick: bool, **overrides: Any) -> Sizes:
    """The sizes of a run, with command-line overrides (``None`` values ignored)."""
    base = QUICK if quick else Sizes()
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def unet_from_conf(size: str) -> UNet:
    """A 4-band, 5-class same-padding U-Net of ``conf/model/unet_<size>.yaml`` (seeded)."""
    torch.manual_seed(0)
    shape = OmegaConf.to_container(OmegaConf.load(CONF / "model" / f"unet_{size}.yaml"))
    shape.pop("defaults")  # type: ignore[union-attr]  # the family's keys, set here
    return UNet(in_channels=4, num_classes=5, padding="same", **shape)  # type: ignore[arg-type]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int,
          warmup: int = 1) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` after ``warmup`` calls, device-synchronised."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


@contextlib.contextmanager
def precision(name: str, device: torch.device) -> Iterator[None]:
    """``fp32`` (TF32 off), ``tf32`` (on, matmul and cuDNN) or ``bf16`` (autocast); restores."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = name == "tf32"
    ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if name == "bf16"
           else contextlib.nullcontext())
    try:
        with ctx:
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


class Peak:
    """Peak memory above the start of a ``with`` block (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.bytes = device, 0
        self._stop = threading.Event()
        self._proc = psutil.Process()
        self._base = self._max = 0
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Peak:
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._base = self._max = self._proc.memory_info().rss
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._max = max(self._max, self._proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            sync(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
            self.bytes = max(self._max, self._proc.memory_info().rss) - self._base

    @property
    def mib(self) -> float:
        return round(self.bytes / MIB, 1)


def step_figures(step: Callable[[], Any], device: torch.device, repeats: int) -> dict[str, Any]:
    """One warm-up ``step()`` (kernel plans, optimiser state), then ``repeats`` timed ones.

    Returns ``{"step_s": fastest, "peak_mib": peak over the timed steps}``; a step that runs
    out of device memory is a figure, not a failure: ``{"fits": False, "note": ...}``; any
    other exception is recorded as ``{"error": ...}`` (:func:`attempt`), so the section's
    other figures stay.
    """
    def measure() -> dict[str, Any]:
        try:
            step()
            with Peak(device) as peak:
                times = timed(step, device, repeats, warmup=0)
        except torch.OutOfMemoryError as e:
            return out_of_memory(e, device)
        return {"fits": True, "step_s": round(min(times), 4), "peak_mib": peak.mib}

    return attempt(measure)


def out_of_memory(e: BaseException, device: torch.device) -> dict[str, Any]:
    """What an out-of-memory step records; the allocator's cache is emptied for the next."""
    peak = torch.cuda.max_memory_allocated(device) / MIB if device.type == "cuda" else None
    e.__traceback__ = None  # frees the step's tensors held by the traceback's frames
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"fits": False, "note": f"out of memory: {str(e)[:160]}", "peak_mib_at_failure": peak}


def attempt(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``, or ``{"error": ...}``: one failing measurement keeps its section's others."""
    try:
        return fn()
    except Exception as e:  # recorded in the JSON; the CPU harness test asserts there is none
        e.__traceback__ = None
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def run_section(name: str, fn: Callable[[], dict[str, Any]],
                device: torch.device) -> dict[str, Any]:
    """``fn()`` with its wall time; an exception becomes ``{"error": ...}``, not a dead run."""
    print(f"== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # one section's failure must not cost the others' figures
        out = {"error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc(limit=6)[-2000:]}
        print(f"   {name} failed: {out['error']}", flush=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out["section_s"] = round(time.perf_counter() - t0, 2)
    return out


def fresh(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A copy of ``model`` on ``device`` (the original stays where it is)."""
    return copy.deepcopy(model).to(device)
