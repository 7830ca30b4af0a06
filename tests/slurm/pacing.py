"""A callback that slows a Slurm job's first run down (not its requeued runs).

The requeue test needs training still running when Slurm's time-limit signal comes (the
controller checks limits every 30 s); sleeping after each batch of the first run keeps
it short in CPU. ``SLURM_RESTART_COUNT`` is set in a requeued job.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytorch_lightning as pl

__all__ = ["PaceFirstRun"]


class PaceFirstRun(pl.Callback):
    """Sleep ``seconds`` after each training batch unless the job was requeued."""

    def __init__(self, seconds: float = 0.25) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0:
            time.sleep(self.seconds)
