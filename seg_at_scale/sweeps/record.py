"""What one training run did, in a small JSON a sweep report reads: ``<run>/trial.json``.

:class:`TrialRecord` is a Lightning callback (in ``callbacks/default.yaml``, so every run
writes it). It keeps the monitored metric after each validation (in each checkpoint too, so
a resumed run's record covers the epochs before it), and at the end of fitting writes the
history, the best value and its epoch, the torch threads the run used, the fits' wall time
and its peak memory. ``best`` is the same number the checkpoint callback keeps
(``val/miou``, mode ``max``): the objective a sweep optimises.

Peak memory is the process's ``VmHWM`` (CPU; reset at fit start through
``/proc/self/clear_refs``, so trials run one after another in one process each get their own
peak) or CUDA's max allocated bytes.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import pytorch_lightning as pl
import torch

from seg_at_scale.errors import ConfigError
from seg_at_scale.memory.report import peak_memory_mib
from seg_at_scale.sweeps.report import RECORD_FILE

__all__ = ["TrialRecord", "reset_peak_rss"]

log = logging.getLogger("seg_at_scale.sweeps")

def reset_peak_rss() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux >= 4.0); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class TrialRecord(pl.Callback):
    """Write ``<dirpath>/trial.json`` at the end of fitting.

    Args:
        dirpath: the run folder.
        monitor: the metric to keep per epoch (the checkpoint's, ``val/miou``).
        mode: ``max`` or ``min``: which value is best.
    """

    def __init__(self, dirpath: str, monitor: str = "val/miou", mode: str = "max") -> None:
        if mode not in ("max", "min"):
            raise ConfigError(f"callbacks.trial_record.mode={mode!r}: use max or min")
        self.path = Path(dirpath) / RECORD_FILE
        self.monitor, self.mode = monitor, mode
        self.history: list[tuple[int, float]] = []
        self._t0 = time.perf_counter()
        self._before_s = 0.0  # the fits before a resume
        self._peak_reset = False

    def state_dict(self) -> dict[str, object]:
        """Kept in each checkpoint: a resumed run's record covers the epochs before it."""
        return {"history": [list(h) for h in self.history],
                "fit_s": self._before_s + time.perf_counter() - self._t0}

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        history = state_dict.get("history")
        if isinstance(history, list):
            self.history = [(int(e), float(v)) for e, v in history]
        fit_s = state_dict.get("fit_s")
        self._before_s = float(fit_s) if isinstance(fit_s, int | float) else 0.0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0 = time.perf_counter()
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
            self._peak_reset = True
        else:
            self._peak_reset = reset_peak_rss()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is not None and math.isfinite(float(value)):
            self.history.append((int(trainer.current_epoch), float(value)))

    def best(self) -> tuple[int, float] | None:
        """``(epoch, value)`` of the best validation so far, or None."""
        if not self.history:
            return None
        pick = max if self.mode == "max" else min
        return pick(self.history, key=lambda h: h[1])

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.history and self.monitor not in trainer.callback_metrics:
            # a rerun with no epoch left to fit validated nothing: the last validation's
            # value, restored with the record, is what the run's summary reports
            trainer.callback_metrics[self.monitor] = torch.tensor(self.history[-1][1])
        if not trainer.is_global_zero:
            return
        best = self.best()
        record = {
            "monitor": self.monitor, "mode": self.mode,
            "best": best[1] if best else None, "best_epoch": best[0] if best else None,
            "history": [list(h) for h in self.history],
            "epochs": int(trainer.current_epoch), "global_step": int(trainer.global_step),
            "threads": torch.get_num_threads(),
            "fit_s": round(self._before_s + time.perf_counter() - self._t0, 2),
            "peak_mem_mib": round(peak_memory_mib(pl_module.device), 1),
            "peak_since_fit_start": self._peak_reset,
            "device": pl_module.device.type,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(record, indent=2) + "\n")
