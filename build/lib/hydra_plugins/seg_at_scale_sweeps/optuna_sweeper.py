"""``hydra/sweeper=seg_optuna``: Bayesian search on optuna 5 with a stored, resumable study.

The logic is :func:`seg_at_scale.sweeps.optuna_sweep.run_study`; this class turns the
sweeper's config into typed values and hands it the launcher.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


class SegOptunaSweeper(Sweeper):
    """Hydra sweeper over optuna (see ``conf/hydra/sweeper/seg_optuna.yaml`` for the keys)."""

    def __init__(self, study_name: str, direction: str, objective: str, n_trials: int,
                 n_jobs: int, seed: int, storage: str | None = None, max_failures: int = 3,
                 sampler: Any = None, pruner: Any = None, params: Any = None,
                 conditions: Any = None) -> None:
        from seg_at_scale.sweeps.optuna_sweep import StudySettings

        self.settings = StudySettings(study_name=study_name, storage=storage,
                                      direction=direction, objective=objective,
                                      n_trials=n_trials, n_jobs=n_jobs, seed=seed,
                                      max_failures=max_failures)
        self.sampler, self.pruner = sampler, pruner
        self.params: dict[str, Any] = _plain(params) or {}
        self.conditions: dict[str, Any] = _plain(conditions) or {}
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        from seg_at_scale.sweeps.optuna_sweep import run_study
        from seg_at_scale.sweeps.space import search_space

        assert self.config is not None and self.launcher is not None
        space = search_space({k: str(v) for k, v in self.params.items()}, arguments,
                             self.conditions)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        seed = self.settings.seed
        make = self.sampler

        def sampler(stored: int) -> Any:
            # a partial (conf: _partial_: true) seeded past the trials already stored
            return make(seed=seed + stored) if callable(make) else None

        return run_study(self.settings, space, sweep_dir,
                         launch=lambda batch, first: self.launcher.launch(batch, first),
                         sampler=sampler, pruner=self.pruner,
                         check=self.validate_batch_is_legal)
