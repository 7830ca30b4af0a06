"""A callback for the stop tests: SIGTERM to its own process at a chosen training batch."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytorch_lightning as pl

__all__ = ["SignalAt"]


class SignalAt(pl.Callback):
    """SIGTERM before batch ``B`` of epoch ``E`` when ``SEG_TEST_STOP_AT=E:B`` is set.

    Set through the environment, so a rerun into the run folder has the same config.
    """

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        at = os.environ.get("SEG_TEST_STOP_AT")
        if at and (trainer.current_epoch, batch_idx) == tuple(map(int, at.split(":"))):
            os.kill(os.getpid(), signal.SIGTERM)
