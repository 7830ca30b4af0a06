"""A callback for the stop tests: SIGTERM to its own process at a chosen training batch,
and, where asked, again while the stopped run exits."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
from typing import Any

import pytorch_lightning as pl

__all__ = ["SignalAt"]


class SignalAt(pl.Callback):
    """SIGTERM before batch ``B`` of epoch ``E`` when ``SEG_TEST_STOP_AT=E:B`` is set.

    Set through the environment, so a rerun into the run folder has the same config. With
    ``SEG_TEST_STOP_AGAIN=1`` a second SIGTERM comes while the stopped run exits, after its
    checkpoint and Lightning's teardown (as a Slurm step's cancel signals its processes
    again): from the interpreter's exit (``atexit``), where torch's teardown takes about
    half a second.
    """

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        at = os.environ.get("SEG_TEST_STOP_AT")
        if at and (trainer.current_epoch, batch_idx) == tuple(map(int, at.split(":"))):
            if os.environ.get("SEG_TEST_STOP_AGAIN") == "1":
                atexit.register(_again)
            os.kill(os.getpid(), signal.SIGTERM)


def _again() -> None:
    print("a second SIGTERM while exiting", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)  # delivered by now
