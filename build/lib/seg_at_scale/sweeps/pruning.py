"""Stop a hopeless trial early: report ``val/miou`` each epoch to the study, ask its pruner.

:class:`OptunaPruning` runs inside the trial's training process (the sweeper may have
launched it in-process, in a child process or on another node). It finds the trial in the
stored study by its number (= Hydra's ``hydra.job.num``, which the sweeper sets to the trial
number), reports the monitored metric after every validation as an intermediate value, and
when the pruner says so marks the trial (user attribute ``pruned_at_epoch``) and asks
Lightning to stop. The sweeper then records the trial as pruned.

Outside a sweep (no such study or trial) it logs one line and does nothing.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytorch_lightning as pl

from seg_at_scale.sweeps.study import open_storage, storage_url

__all__ = ["OptunaPruning", "PRUNED_AT"]

log = logging.getLogger("seg_at_scale.sweeps")

PRUNED_AT = "pruned_at_epoch"  # user attribute the sweeper reads


class OptunaPruning(pl.Callback):
    """Report the monitored metric per epoch to an optuna trial; stop when it is pruned.

    Args:
        study_name: the study's name.
        trial: the trial number (``${hydra:job.num}``; None outside a multirun).
        sweep_dir: the sweep folder (default storage location).
        storage: database URL, or None for ``<sweep_dir>/optuna.db``.
        monitor: the metric (``val/miou``).
        pruner: the study's optuna pruner (e.g. ``MedianPruner``); None: optuna's default.
    """

    def __init__(self, study_name: str, trial: int | None, sweep_dir: str,
                 storage: str | None = None, monitor: str = "val/miou", pruner: Any = None) -> None:
        self.study_name, self.monitor = study_name, monitor
        self.number = None if trial is None else int(trial)  # None: not a sweep's job
        self.url = storage_url(storage, sweep_dir)
        self.pruner = pruner
        self.trial: Any = None
        self.pruned_at: int | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero or self.number is None:
            return
        import optuna

        storage = open_storage(self.url)
        try:
            study = optuna.load_study(study_name=self.study_name, storage=storage,
                                      pruner=self.pruner,
                                      sampler=optuna.samplers.RandomSampler())
            trial_id = storage.get_trial_id_from_study_id_trial_number(
                storage.get_study_id_from_name(self.study_name), self.number)
        except KeyError:
            log.info("no trial %d of study '%s' in %s: not pruning this run", self.number,
                     self.study_name, self.url)
            return
        self.trial = optuna.trial.Trial(study, trial_id)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        prune = False
        value = trainer.callback_metrics.get(self.monitor)
        if self.trial is not None and value is not None and math.isfinite(float(value)):
            epoch = int(trainer.current_epoch)
            self.trial.report(float(value), step=epoch)
            if self.trial.should_prune():
                self.trial.set_user_attr(PRUNED_AT, epoch)
                self.pruned_at, prune = epoch, True
                log.info("trial %d pruned after epoch %d (%s = %.4f)", self.number, epoch,
                         self.monitor, float(value))
        # rank 0 decides; every rank of a multi-process run stops together
        if trainer.strategy.broadcast(prune, src=0):
            trainer.should_stop = True
