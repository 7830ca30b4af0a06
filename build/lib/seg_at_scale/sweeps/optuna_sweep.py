"""The ask / launch / tell loop behind ``hparams_search=optuna`` (the project's Hydra sweeper).

Each round asks the study for ``n_jobs`` trials, turns their sampled values into Hydra
overrides, launches them together through the configured launcher (in-process, k local
processes, SLURM) with job numbers equal to the trial numbers (so ``<sweep dir>/<n>`` is trial
``n`` and a resumed sweep never reuses a folder), and tells the study each outcome:

* complete: the run's best monitored value (``trial.json``, the number the checkpoint kept);
* pruned: the pruning callback stopped it (user attribute ``pruned_at_epoch``);
* failed: the job raised, died, or recorded no value.

Rounds continue until the study holds ``n_trials`` finished trials, counting those of
earlier, interrupted invocations (:func:`seg_at_scale.sweeps.study.open_study`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from seg_at_scale.errors import ConfigError
from seg_at_scale.sweeps.pruning import PRUNED_AT
from seg_at_scale.sweeps.report import read_record
from seg_at_scale.sweeps.space import SearchSpace
from seg_at_scale.sweeps.study import open_study, storage_url

__all__ = ["StudySettings", "run_study", "job_outcome", "RESULTS_FILE"]

log = logging.getLogger("seg_at_scale.sweeps")

RESULTS_FILE = "optimization_results.yaml"


@dataclass(frozen=True)
class StudySettings:
    """The sweeper's settings (``hydra.sweeper.*``), checked once.

    Attributes:
        study_name: the study's name in its storage.
        storage: database URL, or None for ``<sweep dir>/optuna.db``.
        direction: ``maximize`` or ``minimize``.
        objective: the metric optimised (``val/miou``); runs must record the same key.
        n_trials: finished trials wanted in the study, over all invocations.
        n_jobs: trials launched together (the launcher runs them side by side).
        seed: sampler seed (a resumed sweep uses ``seed + stored trials``).
        max_failures: failed trials this invocation tolerates before it stops.
    """

    study_name: str
    storage: str | None
    direction: str
    objective: str
    n_trials: int
    n_jobs: int
    seed: int
    max_failures: int

    def __post_init__(self) -> None:
        for key in ("n_trials", "n_jobs"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"hydra.sweeper.{key}={value!r}: use an integer >= 1")
        if not isinstance(self.max_failures, int) or self.max_failures < 0:
            raise ConfigError(f"hydra.sweeper.max_failures={self.max_failures!r}: use an "
                              "integer >= 0 (failed trials tolerated before the sweep stops)")
        if not self.study_name:
            raise ConfigError("hydra.sweeper.study_name is empty: name the study")


def job_outcome(ret: Any, objective: str, pruned_at: int | None) -> tuple[str, float | None]:
    """``(state, value)`` of a finished job: ``complete``, ``pruned`` or ``failed``.

    Args:
        ret: Hydra's ``JobReturn``.
        objective: the metric the sweep optimises.
        pruned_at: the epoch the pruning callback stopped the trial at, or None.

    Raises:
        ConfigError: the run recorded a different metric than ``objective``.
    """
    from hydra.core.utils import JobStatus

    if ret.status != JobStatus.COMPLETED:
        return "failed", None
    if pruned_at is not None:
        return "pruned", None
    record = read_record(ret.hydra_cfg.hydra.runtime.output_dir) if ret.hydra_cfg else None
    if record is not None and record.get("monitor") != objective:
        raise ConfigError(f"hydra.sweeper.objective={objective!r} but the runs record "
                          f"{record.get('monitor')!r} (callbacks.trial_record.monitor): make "
                          "them the same key (optimized_metric)")
    value = record.get("best") if record else ret.return_value
    if value is None or not math.isfinite(float(value)):
        return "failed", None
    return "complete", float(value)


def run_study(settings: StudySettings, space: SearchSpace, sweep_dir: str | Path,
              launch: Callable[[list[list[str]], int], Sequence[Any]],
              sampler: Callable[[int], Any] | None = None, pruner: Any = None,
              check: Callable[[list[list[str]]], None] | None = None) -> list[Any]:
    """Run (or continue) the study until it holds ``settings.n_trials`` finished trials.

    Args:
        settings: the sweeper's settings.
        space: what to search and the fixed overrides.
        sweep_dir: the sweep folder (default storage; ``optimization_results.yaml``).
        launch: ``(batch of overrides, first job number) -> JobReturns`` (the launcher).
        sampler: makes the sampler from the number of stored trials.
        pruner: the study's pruner.
        check: composes a batch before launching (Hydra's ``validate_batch_is_legal``).

    Returns:
        The JobReturns of the trials this invocation ran.
    """
    from optuna.trial import TrialState

    url = storage_url(settings.storage, sweep_dir)
    study, resume = open_study(url, settings.study_name, settings.direction, sampler, pruner)
    todo = settings.n_trials - resume.finished
    log.info("study '%s' in %s: %d finished trials stored, %d to run, %d at a time",
             settings.study_name, url, resume.finished, max(todo, 0), settings.n_jobs)
    returns: list[Any] = []
    failures = 0
    while todo > 0:
        trials = [study.ask() for _ in range(min(settings.n_jobs, todo))]
        try:
            batch = [space.overrides(space.suggest(t)) for t in trials]
            if [t.number for t in trials] != list(range(trials[0].number,
                                                        trials[0].number + len(trials))):
                raise RuntimeError(f"trials {[t.number for t in trials]} are not consecutive: "
                                   "another sweeper is asking this study; run one at a time")
            if check is not None:
                check(batch)
            done = launch(batch, trials[0].number)
        except BaseException:
            for t in trials:
                study.tell(t, state=TrialState.FAIL, skip_if_finished=True)
            raise
        failed = _tell(study, trials, done, settings.objective)
        failures += len(failed)
        if failed and failures > settings.max_failures:
            failed[-1].return_value  # re-raises the job's own exception  # noqa: B018
            raise RuntimeError(f"{failures} trials failed, no objective recorded "
                               f"(hydra.sweeper.max_failures={settings.max_failures})")
        returns.extend(done)
        todo -= len(trials)
    _write_results(study, Path(sweep_dir), settings)
    return returns


def _tell(study: Any, trials: Sequence[Any], done: Sequence[Any], objective: str) -> list[Any]:
    """Tell the study how each launched trial ended; the JobReturns of the failed ones."""
    from optuna.trial import TrialState

    stored = {t.number: t for t in study.get_trials(deepcopy=False)}  # fresh user attrs
    failed = []
    for trial, ret in zip(trials, done):
        state, value = job_outcome(ret, objective, stored[trial.number].user_attrs.get(PRUNED_AT))
        if state == "complete":
            study.tell(trial, value)
        elif state == "pruned":
            study.tell(trial, state=TrialState.PRUNED)
        else:
            study.tell(trial, state=TrialState.FAIL)
            log.warning("trial %d failed: %s", trial.number, _error_of(ret))
            failed.append(ret)
    return failed


def _error_of(ret: Any) -> str:
    value = getattr(ret, "_return_value", None)
    return repr(value) if isinstance(value, BaseException) else "no objective recorded"


def _write_results(study: Any, sweep_dir: Path, settings: StudySettings) -> None:
    """``optimization_results.yaml``: the best trial (the file Hydra's optuna plugin writes)."""
    from optuna.trial import TrialState

    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        log.warning("study '%s' has no complete trial", settings.study_name)
        return
    best = study.best_trial
    doc = {"name": "optuna", "study_name": settings.study_name, "objective": settings.objective,
           "direction": settings.direction, "best_trial": best.number,
           "best_value": best.value, "best_params": best.params}
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / RESULTS_FILE).write_text(yaml.safe_dump(doc, sort_keys=False))
    log.info("best trial %d: %s = %.4f with %s", best.number, settings.objective, best.value,
             best.params)
