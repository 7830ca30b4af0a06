"""``hydra/launcher=local_parallel``: k jobs at once on one machine, cores split between them.

The logic is :func:`seg_at_scale.sweeps.launcher.launch_local`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, configure_log, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict


class LocalParallelLauncher(Launcher):
    """Run a batch of jobs ``n_jobs`` at a time, each in its own process with its thread share.

    Args:
        n_jobs: jobs running at once.
        cores: cores to share; None = the CPUs this process may use.
    """

    def __init__(self, n_jobs: int = 2, cores: int | None = None) -> None:
        from seg_at_scale.sweeps.launcher import available_cores, threads_per_job

        self.n_jobs = int(n_jobs)
        self.cores = int(cores) if cores is not None else available_cores()
        self.threads = threads_per_job(self.cores, self.n_jobs)
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        import logging

        from seg_at_scale.sweeps.launcher import JobSpec, launch_local, task_reference

        assert self.config is not None and self.hydra_context is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log = logging.getLogger(__name__)
        log.info("Launching %d jobs, %d at a time, %d torch threads each (%d cores)",
                 len(job_overrides), self.n_jobs, self.threads, self.cores)
        specs = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config,
                                                                     list(overrides))
            with open_dict(cfg):
                cfg.hydra.job.id = cfg.hydra.job.num = idx
            specs.append(JobSpec(task_reference(self.task_function), cfg, self.hydra_context,
                                 Singleton.get_state()["instances"], self.threads))
        returns = launch_local(specs, self.n_jobs)
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return returns
