"""The stored optuna study of a sweep: where it lives, how a rerun picks it up.

A study is kept in a database next to the sweep's runs (``<sweep dir>/optuna.db``, SQLite)
or at any SQLAlchemy URL. Rerunning the same sweep command opens it again
(:func:`open_study`) and continues: finished trials (complete, pruned, failed) are counted
toward ``n_trials`` and never run again; a trial left *running* by a killed sweep is marked
failed with the user attribute ``interrupted`` and its parameters are queued, so the next
trial repeats it.

>>> storage_url(None, "/sweeps/a")
'sqlite:////sweeps/a/optuna.db'
>>> storage_url("postgresql://db/optuna", "/sweeps/a")
'postgresql://db/optuna'
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from seg_at_scale.errors import ConfigError

__all__ = ["STUDY_FILE", "Resume", "storage_url", "open_storage", "open_study",
           "finished_trials", "requeue_running", "INTERRUPTED"]

log = logging.getLogger("seg_at_scale.sweeps")

STUDY_FILE = "optuna.db"  # the default storage, inside the sweep folder
INTERRUPTED = "interrupted"  # user attribute of a trial a killed sweep left running
SQLITE_TIMEOUT_S = 60  # trials report intermediate values while the sweeper writes


def storage_url(storage: str | None, sweep_dir: str | os.PathLike[str]) -> str:
    """The study's database URL: ``storage``, or SQLite in the sweep folder when None."""
    if storage:
        return str(storage)
    return f"sqlite:///{Path(sweep_dir).resolve() / STUDY_FILE}"


def open_storage(url: str) -> Any:
    """An optuna RDB storage; SQLite waits up to a minute for a lock instead of failing."""
    import optuna

    kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}} if url.startswith("sqlite") else {}
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)


@dataclass(frozen=True)
class Resume:
    """What a (re)opened study already holds.

    Attributes:
        finished: trials that count toward ``n_trials`` (complete, pruned, failed).
        requeued: numbers of trials a killed sweep left running, queued to run again.
    """

    finished: int
    requeued: tuple[int, ...]


def finished_trials(study: Any) -> list[Any]:
    """Trials that count toward ``n_trials``: complete, pruned, and failed but not interrupted."""
    from optuna.trial import TrialState

    done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    return [t for t in study.get_trials(deepcopy=False, states=done)
            if not t.user_attrs.get(INTERRUPTED)]


def requeue_running(storage: Any, study: Any, numbers: Sequence[int] | None = None
                    ) -> list[int]:
    """Mark running trials failed and ``interrupted``, and queue their parameters again.

    Their jobs never reported (the sweep was killed, stopped, or its jobs cancelled): a
    rerun repeats them instead of counting them as failures.

    Args:
        storage: the study's storage (:func:`open_storage`).
        study: the optuna study.
        numbers: only these trials (those still running among them); None: every one.

    Returns:
        The numbers of the trials requeued.
    """
    from optuna.trial import TrialState

    study_id = storage.get_study_id_from_name(study.study_name)
    requeued = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if numbers is not None and t.number not in numbers:
            continue
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        storage.set_trial_user_attr(trial_id, INTERRUPTED, True)
        storage.set_trial_state_values(trial_id, TrialState.FAIL)
        study.enqueue_trial(t.params, user_attrs={"rerun_of": t.number})
        requeued.append(t.number)
    return requeued


def open_study(url: str, study_name: str, direction: str,
               sampler: Callable[[int], Any] | None = None,
               pruner: Any = None) -> tuple[Any, Resume]:
    """Create the study, or load it with its trials; requeue trials a killed sweep left running.

    One sweeper drives a study at a time: every trial still *running* when it starts belongs
    to a sweep that died.

    Args:
        url: database URL (:func:`storage_url`).
        study_name: the study's name in that database.
        direction: ``maximize`` or ``minimize``.
        sampler: makes the optuna sampler from the number of trials stored (a seeded
            sampler reseeded with ``seed + stored`` does not repeat the first run's proposals
            after a restart); None: optuna's default.
        pruner: optuna pruner (None: optuna's default).

    Returns:
        ``(study, resume)``.

    Raises:
        ConfigError: ``direction`` is neither, or differs from the stored study's.
    """
    import optuna

    if direction not in ("maximize", "minimize"):
        raise ConfigError(f"hydra.sweeper.direction={direction!r}: use maximize or minimize")
    storage = open_storage(url)
    study = optuna.create_study(storage=storage, study_name=study_name,
                                direction=cast(Literal["maximize", "minimize"], direction),
                                pruner=pruner, load_if_exists=True)
    if sampler is not None:
        study.sampler = sampler(len(study.trials))
    if study.direction.name.lower() != direction:
        raise ConfigError(f"hydra.sweeper.direction={direction}: study '{study_name}' in {url} "
                          f"was created to {study.direction.name.lower()}; keep its direction "
                          "or start a new study (hydra.sweeper.study_name=<new name>)")
    requeued = requeue_running(storage, study)
    if requeued:
        log.warning("study '%s': trials %s were left running by a stopped sweep; marked "
                    "failed (interrupted) and queued again", study_name, requeued)
    return study, Resume(len(finished_trials(study)), tuple(requeued))
