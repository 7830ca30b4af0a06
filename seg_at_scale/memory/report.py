"""Log what a memory mode and precision cost: peak memory and step time per training step.

:class:`MemoryReport` is a Lightning callback. Each training step it logs
``train/step_s`` (wall time of the step), ``train/mpix_per_s`` (input pixels per second)
and ``train/peak_mem_mib`` (peak resident memory of the process on CPU, or
``torch.cuda.max_memory_allocated`` on a GPU), and at the end of fitting it shows one line
per run, once (logged, and printed where no handler shows it), e.g.
``memory=checkpoint precision=32-true: peak 1834 MiB, step 0.92 s (median), 1.31 Mpix/s``,
so a user sees what the choice cost.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import pytorch_lightning as pl
import torch

from seg_at_scale.memory.probe import peak_rss_bytes

__all__ = ["MemoryReport", "peak_memory_mib"]

log = logging.getLogger("seg_at_scale.memory")


def peak_memory_mib(device: torch.device | None = None) -> float:
    """Peak memory so far: CUDA max allocated on a GPU, else this process's peak RSS."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_bytes() / 2**20


class MemoryReport(pl.Callback):
    """Measure peak memory and step time of every training step.

    Args:
        mode: the memory mode's name (for the summary line).
        skip_first: steps left out of the median time (warm-up).
    """

    def __init__(self, mode: str = "none", skip_first: int = 1) -> None:
        self.mode, self.skip_first = mode, skip_first
        self.times: list[float] = []
        self.pixels = 0
        self.seconds = 0.0
        self._t0 = 0.0
        self.summary: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        dt = time.perf_counter() - self._t0
        image = batch["image"] if isinstance(batch, dict) else batch[0]
        px = int(image.shape[0] * image.shape[-2] * image.shape[-1])
        self.times.append(dt)
        self.pixels += px
        self.seconds += dt
        peak = peak_memory_mib(pl_module.device)
        pl_module.log_dict({"train/step_s": dt, "train/mpix_per_s": px / 1e6 / max(dt, 1e-9),
                            "train/peak_mem_mib": peak}, on_step=True, on_epoch=False,
                           batch_size=1)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.times:
            return
        steady = self.times[self.skip_first:] or self.times
        self.summary = {
            "memory_mode": self.mode, "precision": str(trainer.precision),
            "peak_mem_mib": round(peak_memory_mib(pl_module.device), 1),
            "step_s_median": round(statistics.median(steady), 4),
            "mpix_per_s": round(self.pixels / 1e6 / max(self.seconds, 1e-9), 4),
            "steps": len(self.times)}
        # each rank measures its own process: said apart (two lines of other figures)
        rank = (f" (rank {trainer.global_rank} of {trainer.world_size})"
                if trainer.world_size > 1 else "")
        line = (f"memory={self.mode} precision={trainer.precision}{rank}: peak "
                f"{self.summary['peak_mem_mib']:.0f} MiB, step {self.summary['step_s_median']:.3g}"
                f" s (median of {len(steady)}), {self.summary['mpix_per_s']:.3g} Mpix/s")
        _say(line)


def _say(line: str) -> None:
    """Log ``line`` at INFO and make sure it is seen once.

    Under Hydra (``seg-train``) the record reaches its console handler; where no handler
    shows INFO records on a stream (a notebook, a script without logging set up) the line
    is printed instead.
    """
    log.info(line)
    if not _on_a_stream(log):
        print(line)


def _on_a_stream(logger: logging.Logger) -> bool:
    """Whether an INFO record of ``logger`` reaches a handler writing to a stream."""
    if not logger.isEnabledFor(logging.INFO):
        return False
    node: logging.Logger | None = logger
    while node is not None:
        for h in node.handlers:
            if (isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
                    and h.level <= logging.INFO):
                return True
        node = node.parent if node.propagate else None
    return False
