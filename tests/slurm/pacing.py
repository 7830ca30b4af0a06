"""A callback that slows a Slurm job down on request, so a test's signal finds it training.

``SEG_TEST_PACE_S=<seconds>`` in the job's environment: sleep that long after each training
batch, unless the job was requeued (``SLURM_RESTART_COUNT``) or signalled (``SIGUSR1``, the
time limit's warning): the requeue test needs its first run still training when the
controller's time-limit check (every 30 s) signals it, cheap in CPU meanwhile, and at full
speed to the image end where the requeue's SIGTERM stops it. ``SEG_TEST_STARTED=<file>``:
created after the first training batch (every signal handler of the run is set by then).
The callback sits in every run's config (a resumed run must have its run's config); only
the environment switches it on.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

__all__ = ["Pace"]


class Pace(pl.Callback):
    """Sleep ``SEG_TEST_PACE_S`` s after each training batch of a job's first run until it is
    signalled; create ``SEG_TEST_STARTED`` after the first."""

    def __init__(self) -> None:
        self.signalled = False
        self._watching = False

    def _watch_usr1(self) -> None:
        """Note SIGUSR1, then hand it to the handler Lightning set (at fit's start)."""
        previous = signal.getsignal(signal.SIGUSR1)

        def note(signum: int, frame: Any) -> None:
            self.signalled = True
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:  # no handler: the signal's own effect
                signal.signal(signal.SIGUSR1, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGUSR1)

        signal.signal(signal.SIGUSR1, note)
        self._watching = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._watching:
            self._watch_usr1()
        marker = os.environ.get("SEG_TEST_STARTED")
        if marker and trainer.is_global_zero and not os.path.exists(marker):
            Path(marker).touch()
        seconds = float(os.environ.get("SEG_TEST_PACE_S") or 0)
        if seconds and int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0:
            end = time.monotonic() + seconds
            while not self.signalled and time.monotonic() < end:
                time.sleep(0.05)
