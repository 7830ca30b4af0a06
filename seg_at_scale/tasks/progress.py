"""What a training run says as it goes: its model's table, then its progress.

:class:`ModelTable` logs the model summary Lightning prints at the start of a fit, less its
FLOPs: Lightning counts them only by running ``example_input_array`` through the network on
every rank, which no model here sets (a forward at the start would need every rank of a
sample-parallel step), so its column and total said 0.

Progress where no live bar is drawn: one log line per epoch.

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
from pytorch_lightning.callbacks import ModelSummary
from pytorch_lightning.utilities.model_summary.model_summary import (
    get_formatted_model_size,
    get_human_readable_count,
)

__all__ = ["EpochLines", "ModelTable", "bar_is_seen"]

log = logging.getLogger("seg_at_scale.train")


def bar_is_seen() -> bool:
    """Whether a live progress bar drawn now would be seen as it goes.

    That is, the console is a terminal or a notebook: Rich's own test, so
    ``FORCE_TERMINAL`` and ``TTY_COMPATIBLE`` count as they do for the bar.
    """
    from rich import get_console

    console = get_console()
    return bool(console.is_terminal or console.is_jupyter)


class ModelTable(ModelSummary):
    """Lightning's model summary without the FLOPs it did not count, logged on rank 0.

    The table (name, type, parameters, mode: Lightning's own figures) and its totals go to
    the console and ``train.log``::

        model: 29.6 K parameters (29.6 K trainable, 0 frozen), 0.118 MB; 47 modules in
        train mode, 0 in eval
          name     type                    params  mode
          model    UNet                    29.6 K  train
          ...
    """

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int,
                  trainable_parameters: int, model_size: float,
                  total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        columns = [(name.lower(), values) for name, values in summary_data
                   if name.strip() and name != "FLOPs"]
        widths = [max(len(name), *(len(v) for v in values)) for name, values in columns]
        rows = [[name for name, _ in columns], *zip(*(values for _, values in columns))]
        table = "\n".join("  " + "  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths))
                          .rstrip() for row in rows)

        def count(n: int) -> str:
            return str(get_human_readable_count(int(n))).strip()

        log.info("model: %s parameters (%s trainable, %s frozen), %s MB; %d modules in train "
                 "mode, %d in eval\n%s", count(total_parameters), count(trainable_parameters),
                 count(total_parameters - trainable_parameters),
                 get_formatted_model_size(model_size), total_training_modes["train"],
                 total_training_modes["eval"], table)


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
