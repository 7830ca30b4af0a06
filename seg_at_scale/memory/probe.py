"""Measure one training step of a model on a square tile: peak memory and time.

On a CPU the step runs in a process of its own, forked from a server that imported torch
once (``multiprocessing`` forkserver), and its peak resident set size (``VmHWM`` of that
process) is the figure: everything a training process holds - interpreter, libraries,
model, optimiser state, activations.
The parent samples the child's RSS and stops it as soon as it passes the budget, so a
tile that does not fit costs only the time to find out. On a GPU the step runs in this
process and ``torch.cuda.max_memory_allocated`` is the figure.

The step is what :class:`~seg_at_scale.tasks.SegmentationTask` does for one tile: forward
(under the precision's autocast), summed cross-entropy, backward, an AdamW step. A small
warm-up step on a tiny tile first allocates the optimiser state and initialises the kernels.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing as mp
import multiprocessing.forkserver as mp_forkserver
import queue as queue_mod
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
from torch import nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.memory.modes import MemoryConfig, apply_memory_mode
from seg_at_scale.memory.precision import normalize_precision
from seg_at_scale.models.contract import SegmentationNetwork
from seg_at_scale.tiling.geometry import Footprint
from seg_at_scale.tiling.halo import footprint
from seg_at_scale.tiling.tile_sides import smallest_side

__all__ = ["StepSpec", "StepMeasure", "measure_step", "probe_server", "run_step",
           "peak_rss_bytes", "warmup_side"]


@dataclass(frozen=True)
class StepSpec:
    """What one measured step runs.

    Attributes:
        memory: the memory mode.
        batch: tiles per step.
        precision: ``32-true``, ``bf16-mixed`` or ``16-mixed`` (short names accepted).
        channels_last: NHWC input, as ``task.channels_last`` does.
        threads: torch intra-op threads in the child (``None``: torch's default).
        repeats: timed steps after the first (the time is the fastest; 0 = time the first).
    """

    memory: MemoryConfig = field(default_factory=MemoryConfig)
    batch: int = 1
    precision: str = "32-true"
    channels_last: bool = False
    threads: int | None = None
    repeats: int = 0


@dataclass(frozen=True)
class StepMeasure:
    """One measured step.

    Attributes:
        side: input tile side in pixels.
        peak_bytes: peak RSS of the child (CPU) or max allocated CUDA memory (GPU).
        base_bytes: the same figure before the measured step (interpreter, model, optimiser).
        seconds: step wall time (``nan`` when stopped or failed).
        cpu_seconds: step CPU time, all threads (``nan`` when stopped or failed).
        fits: the step completed within the budget.
        note: why it did not fit (``"over budget"``, an error message) or ``""``.
    """

    side: int
    peak_bytes: int
    base_bytes: int
    seconds: float
    fits: bool
    note: str = ""
    cpu_seconds: float = float("nan")

    @property
    def seconds_per_mpix(self) -> float:
        return self.seconds / (self.side * self.side / 1e6)

    @property
    def cpu_seconds_per_mpix(self) -> float:
        """CPU time (all threads) per input Mpix: steadier than wall time on a shared machine."""
        return self.cpu_seconds / (self.side * self.side / 1e6)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``VmHWM``), in bytes.

    Not ``ru_maxrss``: Linux carries that across ``exec``, so a started child could report
    its *parent's* size at fork time; ``VmHWM`` belongs to the child's own address space.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _autocast(device: torch.device, precision: str) -> Any:
    name = normalize_precision(precision)
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(name)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def _one_step(net: nn.Module, opt: torch.optim.Optimizer, side: int, spec: StepSpec,
              device: torch.device, bands: int, classes: int) -> tuple[float, float]:
    x = torch.randn(spec.batch, bands, side, side, device=device)
    if spec.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    t0, c0 = time.perf_counter(), time.process_time()
    with _autocast(device, spec.precision):
        y = net(x)
    target = torch.randint(0, classes, (spec.batch, *y.shape[-2:]), device=device)
    loss = nn.functional.cross_entropy(y.float(), target, reduction="sum") / target.numel()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, time.process_time() - c0


def warmup_side(fp: Footprint) -> int:
    """The tile of the warm-up step: the smallest input the network takes (4 aligned blocks).

    Not the smallest *legal* tile (one block of core plus the context on both sides): for a
    network with a wide context (UResNet-medium: 624 px) that is as large as the first
    probes, and on a CPU the figure is the process's high-water mark, so the warm-up's own
    peak would hide the measured step's whenever the step needs less.
    """
    if fp.padding == "valid":
        return smallest_side(fp)
    return min(smallest_side(fp), 4 * fp.align)


def run_step(model: nn.Module, side: int, spec: StepSpec,
             device: str | torch.device = "cpu") -> dict[str, float]:
    """Warm up, then run the measured step(s) in this process.

    Returns:
        ``{"seconds", "cpu_seconds", "base_bytes", "peak_bytes"}``; the memory figures are
        this process's peak RSS on CPU (meaningful in a fresh process) or CUDA allocator
        peaks.
    """
    dev = torch.device(device)
    if spec.threads:
        torch.set_num_threads(spec.threads)
    net = apply_memory_mode(model.to(dev), spec.memory).train()
    if not isinstance(model, SegmentationNetwork):
        raise ConfigError(f"the memory probe needs a network of the model contract (bands, "
                          f"classes, footprint); {type(model).__name__} is not one")
    bands, classes = model.in_channels, model.num_classes
    opt = torch.optim.AdamW(net.parameters(), lr=1e-6)
    _one_step(net, opt, min(warmup_side(footprint(model)), side), spec, dev, bands, classes)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    else:
        base = peak_rss_bytes()
    times = [_one_step(net, opt, side, spec, dev, bands, classes) for _ in range(1 + spec.repeats)]
    peak = (torch.cuda.max_memory_allocated(dev) if dev.type == "cuda"
            else peak_rss_bytes())
    best = min(times[1:] or times)
    return {"seconds": best[0], "cpu_seconds": best[1], "base_bytes": base, "peak_bytes": peak}


CAP_SLACK = 1 << 30  # the child's hard allocation cap: budget + 1 GiB


def _cap_memory(cap_bytes: int) -> None:
    """Make allocations past ``cap_bytes`` fail in this process, not in the OOM killer.

    One large allocation (a convolution's column buffer) can outgrow the budget between
    two RSS samples of the parent.
    """
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = cap_bytes if hard == resource.RLIM_INFINITY else min(cap_bytes, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))


def _child(model: nn.Module, side: int, spec: StepSpec, out: mp.Queue,
           cap_bytes: int | None = None) -> None:
    try:
        if cap_bytes is not None:
            _cap_memory(cap_bytes)
        out.put(("ok", run_step(model, side, spec, "cpu")))
    except BaseException as e:  # report to the parent instead of hanging it
        out.put(("error", f"{type(e).__name__}: {e}"))


def _probe_context() -> Any:
    """Where CPU probes start: forks of a server that imported torch once.

    The first probe starts the server. A fresh interpreter per probe would import torch
    again for every tile size a search tries; a fork of this process would carry its
    memory into the measurement.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", __name__])
    return ctx


_SERVER_USERS = 0  # open probe_server() blocks in this process


@contextlib.contextmanager
def probe_server() -> Iterator[None]:
    """CPU probes inside the block fork from one server, stopped when the outermost block ends.

    An idle server holds ~300 MB (torch) that the training after a search would not have
    in its budget. :func:`measure_step` opens a block of its own.
    """
    global _SERVER_USERS
    _SERVER_USERS += 1
    try:
        yield
    finally:
        _SERVER_USERS -= 1
        if _SERVER_USERS == 0:
            server = getattr(mp_forkserver, "_forkserver", None)
            stop = getattr(server, "_stop", None)  # the standard library's own shutdown
            if stop is not None:
                stop()


def measure_step(model: nn.Module, side: int, spec: StepSpec, *,
                 budget_bytes: int | None = None, device: str | torch.device = "cpu",
                 poll_s: float = 0.02) -> StepMeasure:
    """Peak memory and time of one training step on a ``side x side`` tile.

    Args:
        model: the plain network (on CPU; it is copied, never changed).
        side: input tile side (a size the model accepts).
        spec: mode, batch, precision.
        budget_bytes: on CPU, stop the child once its RSS passes this (``fits=False``); the
            child also cannot allocate more than this + 1 GiB (``RLIMIT_DATA``), so a
            sudden large allocation fails there rather than exhausting the machine.
        device: ``"cpu"`` (a child process of its own) or a CUDA device (this process).
        poll_s: RSS sampling period.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        return _measure_cuda(model, side, spec, dev, budget_bytes)
    with probe_server():
        return _measure_cpu(model, side, spec, budget_bytes, poll_s)


def _measure_cpu(model: nn.Module, side: int, spec: StepSpec, budget_bytes: int | None,
                 poll_s: float) -> StepMeasure:
    ctx = _probe_context()
    out: mp.Queue = ctx.Queue()
    cap = None if budget_bytes is None else budget_bytes + CAP_SLACK
    proc = ctx.Process(target=_child, args=(model, side, spec, out, cap), daemon=True)
    proc.start()
    ps, sampled, result = psutil.Process(proc.pid), 0, None
    while result is None:
        try:
            sampled = max(sampled, ps.memory_info().rss)
        except psutil.Error:
            pass
        if budget_bytes is not None and sampled > budget_bytes:
            proc.kill()
            proc.join()
            return StepMeasure(side, sampled, 0, float("nan"), False, "over budget")
        try:
            result = out.get(timeout=poll_s)
        except queue_mod.Empty:
            if not proc.is_alive():
                result = ("error", f"the step's process died (exit code {proc.exitcode})")
    proc.join()
    status, value = result
    if status != "ok":
        return StepMeasure(side, sampled, 0, float("nan"), False, str(value))
    peak = max(int(value["peak_bytes"]), sampled)
    fits = budget_bytes is None or peak <= budget_bytes
    return StepMeasure(side, peak, int(value["base_bytes"]), float(value["seconds"]), fits,
                       "" if fits else "over budget", float(value["cpu_seconds"]))


def _measure_cuda(model: nn.Module, side: int, spec: StepSpec, dev: torch.device,
                  budget_bytes: int | None) -> StepMeasure:
    net = copy.deepcopy(model)
    torch.cuda.empty_cache()
    try:
        r = run_step(net, side, spec, dev)
    except torch.cuda.OutOfMemoryError as e:
        return StepMeasure(side, torch.cuda.max_memory_allocated(dev), 0, float("nan"), False,
                           f"out of memory: {str(e)[:80]}")
    finally:
        del net
        torch.cuda.empty_cache()
    fits = budget_bytes is None or r["peak_bytes"] <= budget_bytes
    return StepMeasure(side, int(r["peak_bytes"]), int(r["base_bytes"]), r["seconds"], fits,
                       "" if fits else "over budget", r["cpu_seconds"])
