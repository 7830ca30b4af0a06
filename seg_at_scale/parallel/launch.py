"""Run a function on ``world`` local processes joined in a torch.distributed group.

Used by the tests and benchmarks of sample parallelism (Lightning launches the training
processes itself, ``trainer=ddp``). Each process gets :func:`cpu_threads` threads.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn", "free_port", "cpu_threads", "rank_world", "barrier"]


def rank_world() -> tuple[int, int]:
    """This process's rank and the world size of the default group ((0, 1) when not distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    """Wait for every rank of the default group (nothing when not distributed)."""
    if rank_world()[1] > 1:
        dist.barrier()


def cpu_threads(processes: int = 1) -> int:
    """Torch threads for each of ``processes`` CPU processes of this node.

    ``OMP_NUM_THREADS`` when set (per process; a Slurm script sets it from
    ``--cpus-per-task``), else the CPUs this process may run on (its affinity: what
    Slurm's task binding, a cgroup cpuset or ``taskset`` allow, not the machine's count)
    shared among the processes. ``os.cpu_count()`` gave every rank of a Slurm task the
    whole node's cores.
    """
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, processes))


def free_port() -> int:
    """A TCP port nobody listens on now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, backend: str,
           threads: int, args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo",
          threads: int | None = None) -> None:
    """Call ``fn(rank, world, *args)`` in ``world`` fresh processes (spawn start method).

    ``fn`` must be importable (a module-level function). Raises if any process fails.
    """
    threads = threads or cpu_threads(world)
    mp.start_processes(_entry, args=(fn, world, free_port(), backend, threads, args),
                       nprocs=world, join=True, start_method="spawn")
