"""Lightning strategies for sample parallelism, Pipe pipelines, and both.

* :class:`SampleParallelStrategy` (``trainer=ddp``): Lightning's DDP process launch,
  process group (gloo on CPU, NCCL on GPU) and samplers, but no ``DistributedDataParallel``
  wrapper. The task accumulates an image's tile gradients locally and calls
  :func:`~seg_at_scale.parallel.launch.all_reduce_gradients` once, on its last tile: the
  *sum* over ranks is the whole-image gradient, exact and independent of how the tiles
  fell on the ranks.
* :class:`PipelineStrategy` (one process, ``pipeline=manual|auto``): leaves Pipe's stages on
  their devices (Pipe refuses ``.to()``); batches go to the first stage's device.
* ``SampleParallelStrategy`` with a pipelined task is the hybrid: DDP across processes, a
  Pipe in each.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy

from seg_at_scale.parallel.launch import cpu_threads, world_size

__all__ = ["SampleParallelStrategy", "PipelineStrategy"]


def _pipe_of(module: Any) -> Any:
    return getattr(module, "pipe", None)


class _KeepsPipeInPlace:
    """Strategy mixin: a task's attached Pipe stays where Pipe put it.

    Pipe refuses ``.to()``; batches go to the first stage's device instead.
    """

    _lightning_module: Any

    @property
    def root_device(self) -> torch.device:
        pipe = _pipe_of(self._lightning_module)
        return pipe.devices[0] if pipe is not None else super().root_device  # type: ignore[misc]

    def model_to_device(self) -> None:
        if _pipe_of(self._lightning_module) is None:
            super().model_to_device()  # type: ignore[misc]


class SampleParallelStrategy(_KeepsPipeInPlace, DDPStrategy):
    """DDP launch and process group; gradients reduced by the task, once per image.

    Not wrapping the module keeps gradients local while an image's tiles accumulate (no
    ``no_sync`` bookkeeping), lets ranks hold different numbers of tiles, and lets each
    process hold a fairscale Pipe (hybrid).
    """

    strategy_name = "sample_parallel"

    def setup_environment(self) -> None:
        """Process group as DDP; on CPU, this node's CPUs split among its processes.

        ``OMP_NUM_THREADS`` (a Slurm task's ``--cpus-per-task``) wins; else the CPUs this
        process may use (:func:`~seg_at_scale.parallel.launch.cpu_threads`).
        """
        super().setup_environment()
        if self.root_device.type == "cpu":
            torch.set_num_threads(cpu_threads(self.num_processes))

    def configure_ddp(self) -> None:
        """Start from rank 0's parameters; no DDP wrapper (the task reduces gradients)."""
        assert self.model is not None
        if world_size() > 1:
            with torch.no_grad():
                for t in [*self.model.parameters(), *self.model.buffers()]:
                    dist.broadcast(t.data, src=0)

    def determine_ddp_device_ids(self) -> list[int] | None:
        if self.root_device.type == "cpu":
            return None
        return [self.root_device.index or 0]


class PipelineStrategy(_KeepsPipeInPlace, SingleDeviceStrategy):
    """One process running a Pipe: the model stays where Pipe put it."""

    strategy_name = "pipeline"

    def __init__(self, device: str | torch.device = "cpu", **kwargs: Any) -> None:
        super().__init__(device=torch.device(device), **kwargs)

