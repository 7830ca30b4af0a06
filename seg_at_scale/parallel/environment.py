"""Which launcher started this process, and the cluster environment Lightning runs under.

One rule, read from the environment variables each launcher sets (no import: a refusal
needs no second of Lightning's import), used by ``seg-predict`` (are the ranks started
for it, or does it start them?) and by Lightning's plugins below. It follows Lightning's
own detection (``SLURMEnvironment``, ``TorchElasticEnvironment``, ``LSFEnvironment``), a
test holds the two together, and adds the MPI launchers.

When no launcher is found, Lightning (the Trainer and Fabric alike) asks ``mpi4py``
whether MPI started the process (``MPIEnvironment.detect``). Importing ``mpi4py.MPI``
calls ``MPI_Init``, and on a machine that has ``mpi4py`` but was not started by ``mpirun``
that can abort the whole process (seen with Open MPI and no ``ssh`` on a lent GPU
machine). :func:`plain_environment` answers Lightning's question with :func:`launcher`,
so a process that no launcher started never imports ``mpi4py``; under Slurm, torchrun,
LSF or an MPI launcher, Lightning chooses as it always does.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

__all__ = ["launcher", "plain_environment", "quiet_srun_hint", "MPI_LAUNCHER_VARIABLES"]

#: one of these is set in every process an MPI launcher starts (Open MPI, MPICH / Intel MPI
#: hydra, PMIx, MVAPICH)
MPI_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
                          "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
_LSF = ("LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_SIZE")


def launcher(env: Mapping[str, str] | None = None) -> str | None:
    """The launcher that started this process: ``"torchelastic"``, ``"slurm"``, ``"lsf"``.

    Or ``"mpi"``, tried in Lightning's order; None when none did (a shell, a notebook,
    ``seg-predict`` before it starts its own ranks).

    A Slurm allocation used interactively (job name ``bash`` or ``interactive``, as
    Lightning reads it) is no launcher: the processes are started by hand inside it.
    """
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchelastic"
    if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return "slurm"
    if all(name in env for name in _LSF):
        return "lsf"
    if any(name in env for name in MPI_LAUNCHER_VARIABLES):
        return "mpi"
    return None


def plain_environment() -> list[Any]:
    """``[LightningEnvironment()]`` when no launcher started this process, else ``[]``.

    Pass it as the Trainer's or Fabric's ``plugins``: with it Lightning uses the plain
    single-machine environment (what its detection ends in there) without probing MPI;
    ``[]`` leaves the choice to Lightning.
    """
    if launcher() is not None:
        return []
    from lightning_fabric.plugins.environments import LightningEnvironment

    return [LightningEnvironment()]


def quiet_srun_hint() -> None:
    """Silence Lightning's "The `srun` command is available on your system but is not used".

    Lightning gives it on every machine with Slurm's tools installed (a login node, a
    workstation with a test cluster) when no Slurm job step started the process, that is
    exactly when no Slurm is meant. The commands are run under Slurm through ``srun`` or
    Hydra's Slurm launcher (README, "Parallel training and Slurm"), where it is not given.
    """
    warnings.filterwarnings("ignore", message="The `srun` command is available")
