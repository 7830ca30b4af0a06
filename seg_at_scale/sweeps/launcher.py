"""Run k Hydra jobs at once on one machine, each in its own process with cores / k threads.

``hydra/launcher=local_parallel`` (``hydra_plugins.seg_at_scale_sweeps``) calls
:func:`launch_local`. Every job runs in its own process forked from a *forkserver* that
imported torch and the task's module once (not forked from the sweeper itself: it holds
database connections and may have started torch's thread pools, neither survives a fork),
with ``torch.set_num_threads`` (and ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``) at
:func:`threads_per_job`, so k trials share the cores instead of k full-size thread pools
fighting over them. A process per job also frees the trial's memory when it ends and makes
its peak RSS its own. The jobs die with the launcher: each asks Linux for SIGKILL when its
parent, the forkserver, exits (``PR_SET_PDEATHSIG``), which it does when the launcher dies;
a killed sweep leaves no orphan training behind.

>>> threads_per_job(cores=16, n_jobs=4), threads_per_job(cores=2, n_jobs=4)
(4, 1)
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import multiprocessing as mp
import os
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, cast

from seg_at_scale.errors import ConfigError

__all__ = ["threads_per_job", "available_cores", "launch_local", "JobSpec"]

log = logging.getLogger("seg_at_scale.sweeps")

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask, which SLURM / taskset restrict)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_job(cores: int, n_jobs: int) -> int:
    """Torch threads for each of ``n_jobs`` jobs sharing ``cores`` (at least one)."""
    if n_jobs < 1 or cores < 1:
        raise ConfigError(f"hydra.launcher: n_jobs={n_jobs}, cores={cores}: both must be >= 1")
    return max(1, cores // n_jobs)


@dataclass
class JobSpec:
    """What a child process needs to run one Hydra job (all picklable).

    Attributes:
        task: ``(module, qualified name)`` of the task function.
        config: the job's composed config (``load_sweep_config``), job number set.
        hydra_context: Hydra's context (config loader, callbacks).
        singletons: Hydra's singleton instances (``Singleton.get_state()["instances"]``).
        threads: torch threads for this job.
    """

    task: tuple[str, str]
    config: Any
    hydra_context: Any
    singletons: Any
    threads: int


def task_reference(task_function: Any) -> tuple[str, str]:
    """``(module, name)`` by which a child process imports the task function again."""
    return task_function.__module__, task_function.__qualname__


def _import_task(ref: tuple[str, str]) -> Any:
    """The undecorated task function: ``@hydra.main`` keeps it as ``__wrapped__``."""
    obj = importlib.import_module(ref[0])
    for part in ref[1].split("."):
        obj = getattr(obj, part)
    return getattr(obj, "__wrapped__", obj)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the forkserver) exits (Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _child(spec: JobSpec, conn: Connection) -> None:
    """Entry point of a job's process: threads, Hydra state, run the job, send its return."""
    _die_with_parent()
    import torch

    torch.set_num_threads(spec.threads)
    from hydra.core.singleton import Singleton
    from hydra.core.utils import run_job, setup_globals
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.basecontainer import BaseContainer

    from seg_at_scale.cli.resolvers import register_resolvers

    # Hydra's singletons (config store, job runtime); this process's own resolvers: the
    # parent's are closures that do not pickle, and setup_globals + ours register them again
    Singleton.set_state({"instances": spec.singletons,
                         "omegaconf_resolvers": BaseContainer._resolvers})
    setup_globals()
    register_resolvers()
    ret = run_job(hydra_context=spec.hydra_context, task_function=_import_task(spec.task),
                  config=spec.config, job_dir_key="hydra.sweep.dir",
                  job_subdir_key="hydra.sweep.subdir")
    # plain configs: the structured-config classes Hydra's plugin scan re-created in this
    # process do not pickle by reference
    ret.cfg, ret.hydra_cfg = (cast(DictConfig, OmegaConf.create(OmegaConf.to_container(c)))
                              if c is not None else None for c in (ret.cfg, ret.hydra_cfg))
    try:
        conn.send(ret)
    except Exception:  # an exception that does not pickle: send its text
        ret.return_value = RuntimeError(repr(ret._return_value))
        conn.send(ret)
    conn.close()


@contextlib.contextmanager
def _thread_environment(threads: int) -> Iterator[None]:
    """Set the OpenMP / MKL thread variables a new process inherits, then restore them."""
    before = {k: os.environ.get(k) for k in THREAD_VARIABLES}
    os.environ.update({k: str(threads) for k in THREAD_VARIABLES})
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _died(spec: JobSpec, code: int | None) -> Any:
    """A failed JobReturn for a child that exited without sending one (killed, OOM)."""
    from hydra.core.utils import JobReturn, JobStatus

    hydra_cfg = spec.config.hydra
    out = os.path.join(str(hydra_cfg.sweep.dir), str(hydra_cfg.sweep.subdir))
    with contextlib.suppress(Exception):
        hydra_cfg.runtime.output_dir = os.path.abspath(out)
    return JobReturn(overrides=list(hydra_cfg.overrides.task), cfg=spec.config,
                     hydra_cfg=spec.config, status=JobStatus.FAILED,
                     _return_value=RuntimeError(f"job {hydra_cfg.job.num} process exited "
                                                f"with code {code} before returning"))


def launch_local(specs: Sequence[JobSpec], n_jobs: int) -> list[Any]:
    """Run the jobs, at most ``n_jobs`` at a time; JobReturns in the order of ``specs``."""
    ctx = mp.get_context("forkserver")
    # the server imports torch and the task's module once; every job forks from it
    ctx.set_forkserver_preload(sorted({"torch", *(s.task[0] for s in specs)}))
    results: list[Any] = [None] * len(specs)
    queue = list(enumerate(specs))
    running: dict[Connection, tuple[int, Any]] = {}
    while queue or running:
        while queue and len(running) < n_jobs:
            i, spec = queue.pop(0)
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(spec, send), name=f"job-{i}")
            with _thread_environment(spec.threads):
                proc.start()
            send.close()  # the child holds the only write end: EOF when it dies
            running[recv] = (i, proc)
        for conn in cast(list[Connection], wait(list(running))):  # of those it was given
            i, proc = running.pop(conn)
            try:
                results[i] = conn.recv()
            except EOFError:
                proc.join()
                results[i] = _died(specs[i], proc.exitcode)
            conn.close()
            proc.join()
    return results
