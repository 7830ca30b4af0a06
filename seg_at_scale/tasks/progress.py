"""Training progress where no live bar is drawn: one log line per epoch.

Lightning's Rich progress bar redraws one line in place, which only a terminal (or a
notebook) shows as it goes; written to a file (a Slurm job's output, ``nohup``, ``| tee``)
it shows nothing until the run ends. Where the bar would not be seen, ``seg-train`` turns
it off and :class:`EpochLines` logs each epoch instead, to the console and ``train.log``::

    epoch 3/12 (32 steps, 21.4 s): train/loss 0.0810, val/miou 0.9120

The seconds are the epoch's, its validation included; the figures are those the bar shows
(Lightning's ``progress_bar_metrics``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytorch_lightning as pl

__all__ = ["EpochLines", "bar_is_seen"]

log = logging.getLogger("seg_at_scale.train")


def bar_is_seen() -> bool:
    """Whether a live progress bar drawn now would be seen as it goes.

    That is, the console is a terminal or a notebook: Rich's own test, so
    ``FORCE_TERMINAL`` and ``TTY_COMPATIBLE`` count as they do for the bar.
    """
    from rich import get_console

    console = get_console()
    return bool(console.is_terminal or console.is_jupyter)


class EpochLines(pl.Callback):
    """Log one line per training epoch on rank 0.

    The line gives the epoch of how many, its steps and seconds, and the figures of the
    progress bar (the epoch's loss, the validation's scores).
    """

    def __init__(self) -> None:
        self._t0 = 0.0
        self._steps = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule
                             ) -> None:
        self._t0, self._steps = time.perf_counter(), 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self._steps += 1

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule
                           ) -> None:
        # after the epoch's validation (Lightning runs it before this hook)
        if not trainer.is_global_zero:
            return
        figures = ", ".join(f"{name} {float(value):.4f}"
                            for name, value in sorted(trainer.progress_bar_metrics.items())
                            if name != "v_num")
        total = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else "?"
        log.info("epoch %d/%s (%d steps, %.1f s)%s", trainer.current_epoch + 1, total,
                 self._steps, time.perf_counter() - self._t0,
                 f": {figures}" if figures else "")
