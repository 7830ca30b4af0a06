"""Run a function on ``world`` local processes joined in a torch.distributed group.

Used by the tests and benchmarks of sample parallelism (Lightning launches the training
processes itself, ``trainer=ddp``). Each process gets ``cores // world`` threads.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn", "free_port"]


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
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    mp.start_processes(_entry, args=(fn, world, free_port(), backend, threads, args),
                       nprocs=world, join=True, start_method="spawn")
