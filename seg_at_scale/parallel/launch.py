"""Processes joined in a torch.distributed group.

Rank and world, the gradient all-reduce of sample parallelism, and :func:`spawn` of a
function on ``world`` local processes (the tests and benchmarks of sample parallelism;
Lightning launches the training processes itself, ``trainer=ddp``), each with
:func:`cpu_threads` threads. Nothing here imports Lightning.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

__all__ = ["spawn", "free_port", "cpu_threads", "rank_world", "world_size", "barrier",
           "all_reduce_gradients", "close_group", "group_of_its_own"]


def rank_world() -> tuple[int, int]:
    """This process's rank and the world size of the default group ((0, 1) when not distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def world_size() -> int:
    """Processes in the default group (1 when not distributed)."""
    return rank_world()[1]


def all_reduce_gradients(params: Iterable[torch.nn.Parameter], op: str = "sum",
                         extra: Tensor | None = None) -> Tensor | None:
    """Sum (or average) the gradients of ``params`` over all ranks, one buffer per device.

    Parameters without a gradient take part with zeros, so ranks that saw no tile of an
    image (pad slots) still join. ``extra`` (e.g. the rank's loss) rides along in the
    first buffer and is returned reduced.
    """
    if op not in ("sum", "mean"):
        raise ValueError(f"op={op!r}: use 'sum' or 'mean'")
    world = world_size()
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_device: dict[torch.device, list[Tensor]] = {}
    for p in params:
        grad = cast(Tensor, p.grad)  # set above
        by_device.setdefault(grad.device, []).append(grad)
    reduced_extra = extra
    for k, (device, grads) in enumerate(sorted(by_device.items(), key=lambda kv: str(kv[0]))):
        parts = [g.reshape(-1) for g in grads]
        if k == 0 and extra is not None:
            parts.append(extra.detach().reshape(-1).to(device, grads[0].dtype))
        flat = torch.cat(parts)
        if world > 1:
            dist.all_reduce(flat)
        if op == "mean":
            flat /= world
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        if k == 0 and extra is not None:
            reduced_extra = flat[offset:].reshape(extra.shape).to(extra.device)
    return reduced_extra


def barrier() -> None:
    """Wait for every rank of the default group (nothing when not distributed)."""
    if rank_world()[1] > 1:
        dist.barrier()


def close_group() -> None:
    """Destroy the default process group once this process's part of the work is done.

    Lightning destroys it at exit for NCCL only. A gloo group left to the interpreter's
    shutdown can abort a rank that finished its work ("terminate called without an active
    exception", SIGABRT), which Slurm records as a failed job. Nothing when not distributed.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def group_of_its_own() -> Iterator[None]:
    """Destroy, on leaving, the default group made inside (Lightning's, by ``fit``).

    A group that was there on entry is the caller's, and stays.
    """
    theirs = dist.is_available() and dist.is_initialized()
    try:
        yield
    finally:
        if not theirs:
            close_group()


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
        close_group()


def spawn(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo",
          threads: int | None = None) -> None:
    """Call ``fn(rank, world, *args)`` in ``world`` fresh processes (spawn start method).

    ``fn`` must be importable (a module-level function). Raises if any process fails.
    """
    threads = threads or cpu_threads(world)
    mp.start_processes(_entry, args=(fn, world, free_port(), backend, threads, args),
                       nprocs=world, join=True, start_method="spawn")
