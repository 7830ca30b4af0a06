"""The cluster environment Lightning runs under, without its MPI probe where no launcher is.

When no launcher is found, Lightning (the Trainer and Fabric alike) asks ``mpi4py``
whether MPI started the process (``MPIEnvironment.detect``). Importing ``mpi4py.MPI``
calls ``MPI_Init``, and on a machine that has ``mpi4py`` but was not started by ``mpirun``
that can abort the whole process (seen with Open MPI and no ``ssh`` on a lent GPU
machine). :func:`plain_environment` answers Lightning's question from the environment
variables every MPI launcher sets, so a process that no launcher started never imports
``mpi4py``; under Slurm, torchrun, LSF or an MPI launcher, Lightning chooses as
it always does.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["plain_environment", "MPI_LAUNCHER_VARIABLES"]

#: one of these is set in every process an MPI launcher starts (Open MPI, MPICH / Intel MPI
#: hydra, PMIx, MVAPICH)
MPI_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
                          "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def plain_environment() -> list[Any]:
    """``[LightningEnvironment()]`` when no launcher started this process, else ``[]``.

    Pass it as the Trainer's or Fabric's ``plugins``: with it Lightning uses the plain
    single-machine environment (what its detection ends in there) without probing MPI;
    ``[]`` leaves the choice to Lightning.
    """
    from lightning_fabric.plugins.environments import (
        LightningEnvironment,
        LSFEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    if any(name in os.environ for name in MPI_LAUNCHER_VARIABLES):
        return []
    # the environments Lightning's detection tries before MPI's, in its order
    if any(env.detect() for env in (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment)):
        return []
    return [LightningEnvironment()]
