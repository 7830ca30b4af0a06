"""fairscale ``Pipe`` for any model of this project (the only module importing fairscale).

A model's flat form (``model.pipeline_layers()``, see :mod:`seg_at_scale.models.layers`)
becomes an ``nn.Sequential`` whose :class:`~seg_at_scale.models.layers.Skip` layers are
fairscale skippable layers: a stash yields ``stash(name, y)``, a pop receives ``yield
pop(name)``, and every skip name lives in its own ``Namespace``, so a U-Net's levels stay
isolated. Pipe splits that sequence by ``balance`` over ``devices``, runs ``chunks``
micro-batches through it (GPipe) and recomputes activations per its ``checkpoint`` mode.

The pipelined layers are the model's own modules: parameters are shared, the model's state
dict stays the checkpoint format, and ``pipe(x)`` equals ``model(x)``.
"""

from __future__ import annotations

import atexit
import copy
import weakref
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from fairscale.nn import Pipe
from fairscale.nn.pipe.skip import Namespace, pop, skippable, stash
from fairscale.nn.pipe.worker import join_workers
from torch import Tensor, nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.models.contract import Pipelined
from seg_at_scale.models.layers import Skip, check_layers

__all__ = ["PipelineConfig", "build_pipe", "pipe_sequential", "check_devices", "close_pipe",
           "close_live_pipes",
           "CHECKPOINT_MODES"]

CHECKPOINT_MODES = ("always", "except_last", "never")
_LIVE: weakref.WeakSet[Pipe] = weakref.WeakSet()


def close_pipe(pipe: Pipe) -> None:
    """Stop a Pipe's stage worker threads (idempotent).

    fairscale joins them in ``Pipeline.__del__``; at interpreter exit that runs after the
    (daemon) workers are frozen and waits forever, so every Pipe built here is closed by an
    ``atexit`` hook while its workers still run.
    """
    pipeline = getattr(pipe, "pipeline", None)
    if pipeline is not None and pipeline.in_queues:
        join_workers(pipeline.in_queues, pipeline.out_queues)
        pipeline.in_queues, pipeline.out_queues = [], []


@atexit.register
def close_live_pipes() -> None:
    """Close every Pipe built here.

    ``seg-train`` calls it when its run is done, before the interpreter exits; ``atexit``
    calls it too, for notebooks and scripts.
    """
    for pipe in list(_LIVE):
        close_pipe(pipe)


@dataclass
class PipelineConfig:
    """A resolved pipeline: what Pipe is built with (and what the run config records).

    Args:
        balance: layers per stage (sums to the number of flat layers).
        devices: one device per stage (``"cpu"``, ``"cuda:1"``; repeats allowed).
        chunks: micro-batches per batch (GPipe's m).
        checkpoint: ``always`` / ``except_last`` / ``never``.
    """

    balance: list[int]
    devices: list[str]
    chunks: int = 1
    checkpoint: str = "except_last"
    source: dict[str, Any] = field(default_factory=dict)  # how the balance was chosen

    def validate(self, num_layers: int, batch_size: int | None = None) -> None:
        """Raise :class:`ConfigError` before any work for a pipeline that cannot run."""
        if not self.balance or any(int(b) < 1 for b in self.balance):
            raise ConfigError(f"pipeline.balance={self.balance}: every stage needs >= 1 "
                              "layer; give a list of positive layer counts")
        if sum(self.balance) != num_layers:
            raise ConfigError(
                f"pipeline.balance={self.balance} sums to {sum(self.balance)}, but the model "
                f"has {num_layers} layers; make it sum to {num_layers} (or use "
                "pipeline=auto)")
        if len(self.devices) < len(self.balance):
            raise ConfigError(
                f"pipeline.devices={self.devices} has {len(self.devices)} device(s) for "
                f"{len(self.balance)} stages; list one device per stage (repeats allowed, "
                "e.g. ['cpu', 'cpu'])")
        check_devices(self.devices)
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ConfigError(f"pipeline.checkpoint={self.checkpoint!r}: use one of "
                              f"{list(CHECKPOINT_MODES)}")
        if self.chunks < 1:
            raise ConfigError(f"pipeline.chunks={self.chunks}: use a positive integer")
        if batch_size is not None and self.chunks > batch_size:
            raise ConfigError(
                f"pipeline.chunks={self.chunks} > batch size {batch_size}: a micro-batch "
                f"needs at least one sample; use chunks <= {batch_size} or a larger "
                "tiling.batch_size")

    def as_dict(self) -> dict[str, Any]:
        """What the run config records."""
        return {"balance": list(self.balance), "devices": list(self.devices),
                "chunks": self.chunks, "checkpoint": self.checkpoint, **self.source}

    def summary(self) -> str:
        stages = ", ".join(f"{d}:{b}" for d, b in zip(self.devices, self.balance))
        return (f"Pipe balance {self.balance} over [{stages}], chunks {self.chunks}, "
                f"checkpoint {self.checkpoint}")


def check_devices(devices: Sequence[str]) -> None:
    """Every device exists on this machine (clear error otherwise)."""
    for d in devices:
        try:
            dev = torch.device(d)
        except RuntimeError as exc:
            raise ConfigError(f"pipeline.devices: {d!r} is not a device ({exc}); use 'cpu' "
                              "or 'cuda:<i>'") from None
        if dev.type == "cuda":
            n = torch.cuda.device_count()
            if n == 0 or (dev.index or 0) >= n:
                raise ConfigError(
                    f"pipeline.devices: {d!r} does not exist ({n} CUDA device(s) here); use "
                    f"'cpu' or cuda:0..cuda:{max(n - 1, 0)}")
        elif dev.type != "cpu":
            raise ConfigError(f"pipeline.devices: {d!r} is not supported; use 'cpu' or "
                              "'cuda:<i>'")


class _SkipBody(nn.Module):
    """Generator forward of one :class:`Skip` layer, in fairscale's stash/pop protocol."""

    def __init__(self, layer: Skip) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Generator[Any, Tensor, Tensor]:
        popped = []
        for name in self.layer.pop:
            popped.append((yield pop(name)))
        y = self.layer(x, *popped)
        for name in self.layer.stash:
            yield stash(name, y)
        return y


def _skippable(layer: Skip, spaces: dict[str, Namespace]) -> nn.Module:
    cls = skippable(stash=layer.stash, pop=layer.pop)(_SkipBody)
    mod = cls(layer)
    for name in (*layer.stash, *layer.pop):
        mod = mod.isolate(spaces[name], only=[name])
    return mod


def _out_of_place(layer: nn.Module) -> nn.Module:
    """A copy of an in-place parameter-free layer (``ReLU(inplace=True)``) that is not.

    A stage's first layer receives a leaf tensor when Pipe recomputes a checkpointed
    micro-batch, and in-place operations on leaves that require grad are illegal.
    """
    if isinstance(layer, Skip):
        body = _out_of_place(layer.body)
        return layer if body is layer.body else Skip(body, pop=layer.pop, stash=layer.stash)
    if getattr(layer, "inplace", False) and not any(True for _ in layer.parameters()):
        layer = copy.deepcopy(layer)
        flagged: Any = layer  # the layer's own flag (ReLU's), not a submodule or tensor
        flagged.inplace = False
    return layer


def pipe_sequential(layers: Sequence[nn.Module],
                    balance: Sequence[int] | None = None) -> nn.Sequential:
    """The flat layers as an ``nn.Sequential`` with fairscale skippable skips.

    Parameter-free modules listed twice (a shared ``MaxPool2d``) are copied, since Pipe
    refuses duplicate children; a module with parameters listed twice is an error. The
    first layer of each stage (by ``balance``) is made out-of-place.
    """
    check_layers(layers)
    starts = {0}
    for b in balance or ():
        starts.add(max(starts) + int(b))
    spaces: dict[str, Namespace] = {}
    seen: set[int] = set()
    out: list[nn.Module] = []
    for i, layer in enumerate(layers):
        if i in starts:
            layer = _out_of_place(layer)
        if id(layer) in seen:
            if any(True for _ in layer.parameters()):
                raise ConfigError(f"layer {layer} appears twice in pipeline_layers() with "
                                  "parameters; a pipeline needs each weight in one stage")
            layer = copy.deepcopy(layer)
        seen.add(id(layer))
        if isinstance(layer, Skip):
            for name in (*layer.stash, *layer.pop):
                spaces.setdefault(name, Namespace())
            layer = _skippable(layer, spaces)
        out.append(layer)
    return nn.Sequential(*out)


def build_pipe(model: nn.Module, cfg: PipelineConfig, batch_size: int | None = None) -> Pipe:
    """Wrap ``model`` (which offers ``pipeline_layers()``) in fairscale's Pipe.

    The model's parameters move to their stages' devices; afterwards move data, not the
    model (Pipe refuses ``.to()``).
    """
    if not isinstance(model, Pipelined):
        raise ConfigError(f"{type(model).__name__} has no pipeline_layers(); it cannot run "
                          "as a pipeline (pipeline=none)")
    layers = model.pipeline_layers()
    cfg.validate(len(layers), batch_size)
    seq = pipe_sequential(layers, cfg.balance)
    devices = [torch.device(d) for d in cfg.devices[: len(cfg.balance)]]
    pipe = Pipe(seq, balance=list(cfg.balance), devices=devices, chunks=cfg.chunks,
                checkpoint=cfg.checkpoint)
    _LIVE.add(pipe)
    return pipe
