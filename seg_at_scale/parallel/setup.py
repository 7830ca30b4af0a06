"""From the ``pipeline`` config group to a built Pipe, a strategy and a logged plan.

``pipeline=none`` (default) runs the plain model. ``pipeline=manual`` takes ``balance``,
``devices``, ``chunks`` and ``checkpoint`` as given. ``pipeline=auto`` profiles the flat
layers on one tile (:mod:`~seg_at_scale.parallel.profile`) and balances ``stages`` by
measured ``time``, ``memory`` or ``params``, or (``balance_by: plan``) lets the planner pick
stages, micro-batches, checkpoint mode and balance under ``memory_cap_gb``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from seg_at_scale.config_check import known_keys
from seg_at_scale.errors import ConfigError
from seg_at_scale.models.contract import Pipelined
from seg_at_scale.parallel.pipe import PipelineConfig, build_pipe, check_devices
from seg_at_scale.parallel.planner import balance_by, plan
from seg_at_scale.parallel.profile import profile_layers

__all__ = ["resolve_pipeline", "setup_pipeline", "pipeline_strategy", "default_devices",
           "MODES", "PipelineGroup", "pipeline_group"]

log = logging.getLogger(__name__)
MODES = ("none", "manual", "auto")


def default_devices(stages: int) -> list[str]:
    """``cuda:0..k-1`` when there are that many GPUs, else ``cpu`` for every stage."""
    n = torch.cuda.device_count()
    if n >= stages:
        return [f"cuda:{i}" for i in range(stages)]
    return ["cpu"] * stages


@dataclass(frozen=True)
class PipelineGroup:
    """The ``pipeline`` config group, validated (as :class:`~seg_at_scale.memory.MemoryConfig`).

    The values come from ``conf/pipeline/*.yaml`` alone: a key a mode needs and the group
    does not give is refused naming it, never filled from a default written here too.
    ``None`` means "not given" (``devices``: one per stage, ``chunks`` under ``plan``: the
    planner's choice).
    """

    mode: str
    balance: tuple[int, ...] | None = None
    devices: tuple[str, ...] | None = None
    chunks: int | None = None
    checkpoint: str | None = None
    stages: int | None = None
    balance_by: str | None = None
    memory_cap_gb: float | None = None
    repeats: int | None = None

    def need(self, key: str) -> Any:
        """The value of ``key``, refused with the key named when the group lacks it."""
        value = getattr(self, key)
        if value is None:
            raise ConfigError(f"pipeline={self.mode} needs pipeline.{key} (see "
                              f"conf/pipeline/{self.mode}.yaml)")
        return value


def pipeline_group(p: Mapping[str, Any] | PipelineGroup) -> PipelineGroup:
    """Validate the ``pipeline`` group once: unknown keys and modes refused with the key."""
    if isinstance(p, PipelineGroup):
        return p
    known_keys("pipeline", p, [f.name for f in fields(PipelineGroup)], ignore=())
    mode = str(p.get("mode"))
    if mode not in MODES:
        raise ConfigError(f"pipeline.mode={mode!r}: use one of {list(MODES)}")
    v = dict(p)
    for key in ("balance", "devices"):
        if v.get(key) is not None:
            v[key] = tuple(v[key])
    return PipelineGroup(**v)


def resolve_pipeline(p: Mapping[str, Any] | PipelineGroup, model: nn.Module,
                     tile_shape: Sequence[int], batch_size: int) -> PipelineConfig | None:
    """The Pipe configuration the ``pipeline`` group asks for (None for ``none``).

    Args:
        p: the ``pipeline`` group (validated by :func:`pipeline_group` if a mapping).
        model: the network (offers ``pipeline_layers()``).
        tile_shape: ``[C, h, w]`` of one training tile (profiled by ``auto``).
        batch_size: samples per step (micro-batches split it).
    """
    g = pipeline_group(p)
    mode = g.mode
    if mode == "none":
        return None
    if not isinstance(model, Pipelined):
        raise ConfigError(f"pipeline={mode}: {type(model).__name__} has no flat layer form "
                          "(pipeline_layers); use pipeline=none")
    n_layers = len(model.pipeline_layers())
    if mode == "manual":
        if g.balance is None:
            raise ConfigError(f"pipeline=manual needs pipeline.balance (layers per stage, "
                              f"summing to {n_layers}); or use pipeline=auto")
        balance = [int(b) for b in g.balance]
        devices = list(g.devices or default_devices(len(balance)))
        cfg = PipelineConfig(balance, devices, int(g.need("chunks")), str(g.need("checkpoint")),
                             {"mode": "manual"})
        cfg.validate(n_layers, batch_size)
        return cfg
    stages = int(g.need("stages"))
    devices = list(g.devices or default_devices(stages))
    if len(devices) < stages:
        raise ConfigError(f"pipeline.stages={stages} but pipeline.devices={devices}; list one "
                          "device per stage")
    check_devices(devices)
    by = str(g.need("balance_by"))
    sample = torch.randn(1, *tile_shape, device=torch.device(devices[0]))
    model.to(sample.device)
    costs = profile_layers(model.pipeline_layers(), sample, repeats=int(g.need("repeats")))
    if by == "plan":
        best = plan(costs, devices[:stages], batch_size, memory_cap_gb=g.memory_cap_gb,
                    chunks=[int(g.chunks)] if g.chunks else None)
        log.info("pipeline plan:\n%s", best.table())
        cfg = PipelineConfig(best.balance, best.devices, best.chunks, best.checkpoint,
                             {"mode": "auto", "balance_by": "plan",
                              "predicted_step_s": round(best.step_s, 4),
                              "predicted_peak_gb": round(best.peak_bytes / 2**30, 3)})
    else:
        balance = balance_by(costs, stages, by)
        cfg = PipelineConfig(balance, devices[:stages], int(g.need("chunks")),
                             str(g.need("checkpoint")), {"mode": "auto", "balance_by": by})
    cfg.validate(n_layers, batch_size)
    return cfg


def setup_pipeline(task: Any, cfg: PipelineConfig | None, batch_size: int) -> None:
    """Build the Pipe on ``task.model`` and attach it to the task (no-op for None)."""
    if cfg is None:
        return
    pipe = build_pipe(task.model, cfg, batch_size)
    task.attach_pipeline(pipe)
    log.info("%s", cfg.summary())
    print(cfg.summary(), flush=True)


def pipeline_strategy(trainer_cfg: Mapping[str, Any],
                      cfg: PipelineConfig | None) -> dict[str, Any]:
    """Trainer keyword for a pipelined run in one process (``trainer=ddp`` has its own)."""
    if cfg is None or trainer_cfg.get("strategy") not in (None, "auto"):
        return {}
    from seg_at_scale.parallel.strategy import PipelineStrategy

    return {"strategy": PipelineStrategy(cfg.devices[0])}
