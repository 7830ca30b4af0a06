"""Memory modes: one config choice each for checkpointing and host-memory offload.

* ``none``: the model as it is.
* ``checkpoint``: activation checkpointing (``torch.utils.checkpoint``, non-reentrant) over
  segments of the flat layer form ``model.pipeline_layers()``, cut per resolution
  ``level``, per ``block`` or every ``k`` ``layers`` (:mod:`seg_at_scale.memory.segments`);
  for library networks without that form (smp), over their stages (``level``) or
  building blocks (``block``) (:mod:`seg_at_scale.memory.block_checkpoint`).
* ``offload``: every tensor autograd saves goes to host memory
  (``torch.autograd.graph.save_on_cpu``, pinned when CUDA is available) - the modern form
  of IBM's "Large Model Support". On a CPU-only machine the tensors already live in host
  memory, so it saves nothing there.
* ``checkpoint_offload``: checkpointing, with the tensors kept between segments (segment
  inputs and stashed skips) copied to host memory; the last segment's saved tensors too.

:func:`apply_memory_mode` returns a module that *shares* the model's modules: the same
parameters, the same ``state_dict`` keys, so checkpoints are interchangeable, and DDP or
tiled training wrap it like any model. Without gradients (validation, prediction) every
mode runs the plain forward pass.

>>> import torch
>>> from seg_at_scale.models import UNet
>>> net = UNet(in_channels=1, num_classes=2, levels=3, base_width=4, padding="same")
>>> ck = apply_memory_mode(net, MemoryConfig("checkpoint", granularity="level"))
>>> list(ck.state_dict()) == list(net.state_dict()), ck.footprint() == net.footprint()
(True, True)
>>> x = torch.randn(1, 1, 40, 24)
>>> torch.allclose(ck(x), net(x), atol=1e-6)
True
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.memory.block_checkpoint import UNIT_GRANULARITIES, checkpointed, find_units
from seg_at_scale.memory.segments import GRANULARITIES, Segment, cut_segments, run_segments
from seg_at_scale.memory.strips import DEFAULT_COLS, DEFAULT_ROWS, run_strips
from seg_at_scale.memory.unet_levels import Level, check_block_size, find_levels
from seg_at_scale.models.contract import Checkpointable, Pipelined, SegmentationNetwork

__all__ = ["MODES", "MemoryConfig", "MemoryWrapped", "apply_memory_mode",
           "pipe_checkpoint_mode", "memory_mode_of"]

MODES = ("none", "checkpoint", "offload", "checkpoint_offload")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryConfig:
    """What the ``memory`` config group sets.

    Attributes:
        mode: one of :data:`MODES`.
        granularity: checkpoint segments: ``"level"``, ``"block"`` or ``"layers"``; or
            ``"strips"``: every level with a skip recomputed in blocks with a halo
            (:mod:`seg_at_scale.memory.strips`; exact, U-shaped models, same padding).
        every: layers per segment when ``granularity="layers"``.
        strip_rows: most core rows per block (each level's resolution) for ``"strips"``.
        strip_cols: most core columns per block at the first level for ``"strips"`` (halved
            per level, never below ``strip_rows``); ``None``: whole rows.
        checkpoint_last: also checkpoint the last segment (off: it would be recomputed at
            once; same peak memory, less time).
        pin_memory: pin the host copies; ``None`` = when CUDA is available.
    """

    mode: str = "none"
    granularity: str = "level"
    every: int = 4
    strip_rows: int = DEFAULT_ROWS
    strip_cols: int | None = DEFAULT_COLS
    checkpoint_last: bool = False
    pin_memory: bool | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"memory.mode={self.mode!r} is not a memory mode: use one of "
                              f"{', '.join(MODES)} (e.g. `memory=checkpoint`)")
        if self.granularity not in (*GRANULARITIES, "strips"):
            raise ConfigError(f"memory.granularity={self.granularity!r}: use one of "
                              f"{', '.join(GRANULARITIES)}, strips")
        if self.granularity == "strips":
            check_block_size(self.strip_rows, self.strip_cols)
        if self.granularity == "strips" and self.offloads:
            raise ConfigError("memory.granularity=strips keeps only a level's boundaries; "
                              "it does not combine with offload: use memory=checkpoint")
        if self.granularity == "layers" and (not isinstance(self.every, int) or self.every < 1):
            raise ConfigError(f"memory.every={self.every!r}: use a whole number of layers >= 1")

    @property
    def label(self) -> str:
        """``mode[:granularity]`` as runs and benchmarks report it: ``checkpoint:strips``.

        The default ``level`` granularity is left out (``checkpoint``).
        """
        if self.checkpoints and self.granularity != "level":
            return f"{self.mode}:{self.granularity}"
        return self.mode

    @property
    def checkpoints(self) -> bool:
        return self.mode in ("checkpoint", "checkpoint_offload")

    @property
    def offloads(self) -> bool:
        return self.mode in ("offload", "checkpoint_offload")


def pipe_checkpoint_mode(cfg: MemoryConfig) -> str:
    """The fairscale ``Pipe(checkpoint=...)`` of a memory mode: recompute inside a pipeline.

    ``checkpoint`` / ``checkpoint_offload`` map to ``"except_last"`` (the micro-batch in
    flight last is recomputed at once anyway, as for :attr:`MemoryConfig.checkpoint_last`;
    ``"always"`` when that is set), the others to ``"never"``.
    """
    if not cfg.checkpoints:
        return "never"
    if cfg.granularity == "strips":
        raise ConfigError("memory.granularity=strips does not run inside a Pipe (its stages "
                          "are cut from the flat layers, not from levels); use "
                          "memory.granularity=level with a pipeline, or pipeline=none")
    return "always" if cfg.checkpoint_last else "except_last"


class _ToHost(torch.autograd.Function):
    """Differentiable copy to (optionally pinned) host memory; the gradient goes back.

    The copy is complete when it returns (a blocking copy): under ``checkpoint_offload``
    ``save_on_cpu`` packs such host tensors with a CPU-side memcpy, which read a
    still-arriving asynchronous copy and gave wrong gradients on a GPU (seen on an H200).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, pin: bool) -> Tensor:
        ctx.device = x.device
        if x.device.type == "cpu":
            return x.view_as(x)  # already in host memory: nothing to copy
        out = torch.empty(x.shape, dtype=x.dtype, pin_memory=pin)
        return out.copy_(x)  # blocking: host code may read ``out`` at once

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad.to(ctx.device), None


class MemoryWrapped(nn.Module):
    """A model run under a memory mode; shares (not copies) the model's modules.

    The model's children, parameters and buffers are registered under their own names,
    so ``state_dict()`` has exactly the model's keys. The model's other public members
    (``footprint``, ``pipeline_layers``, ``downsampling_factor`` ...) are members of the
    wrapper's class (:func:`apply_memory_mode` makes one per model), so the wrapper has
    the model's capabilities also where ``isinstance`` checks a protocol without calling
    ``__getattr__`` (Python 3.12 and later).

    Args:
        model: a network; checkpointing needs its flat form ``pipeline_layers()`` or, for
            library networks (smp), ``checkpoint_roots()``: the modules whose building
            blocks are checkpointed (:mod:`seg_at_scale.memory.block_checkpoint`).
        cfg: the memory mode.
    """

    def __init__(self, model: nn.Module, cfg: MemoryConfig) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in model.named_buffers(recurse=False):
            self.register_buffer(name, b)
        object.__setattr__(self, "inner", model)  # not a child: keeps the state-dict keys
        self.memory = cfg
        self._segments: list[Segment] = []
        self._levels: list[Level] = []
        self._units: list[nn.Module] = []
        if cfg.checkpoints and _by_units(model):
            self._units = _units_of(model, cfg)
        elif cfg.checkpoints and cfg.granularity == "strips":
            if not isinstance(model, Pipelined):
                raise ConfigError(f"memory.granularity=strips needs the flat layer form, but "
                                  f"{type(model).__name__} has no pipeline_layers(); use "
                                  "memory=offload or memory=none for this model")
            padding = model.footprint().padding if isinstance(model, SegmentationNetwork) \
                else "same"
            if padding != "same":
                raise ConfigError(f"memory.granularity=strips needs padding='same', not "
                                  f"{padding!r}; use memory.granularity=level")
            self._levels = find_levels(model.pipeline_layers())
            if not self._levels:
                raise ConfigError(f"memory.granularity=strips: {type(model).__name__} has no "
                                  "level with a skip to split; use memory.granularity=level")
        elif cfg.checkpoints:
            if not isinstance(model, Pipelined):
                raise ConfigError(
                    f"memory.mode={cfg.mode!r} needs the flat layer form, but "
                    f"{type(model).__name__} has no pipeline_layers(); use memory=offload or "
                    "memory=none for this model")
            self._segments = cut_segments(model.pipeline_layers(), cfg.granularity,
                                          every=cfg.every, owner=model)
            if len(self._segments) < 2 and not cfg.checkpoint_last:
                log.warning("memory.granularity=%s cuts %s into one segment: nothing is "
                            "checkpointed; use memory.granularity=block or layers",
                            cfg.granularity, type(model).__name__)
        self.train(model.training)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "inner"), name)

    def __reduce__(self) -> tuple[Any, ...]:
        # the class is made per model (_wrapper_class): pickle and deepcopy rebuild it
        return apply_memory_mode, (self.inner, self.memory)

    def train(self, mode: bool = True) -> MemoryWrapped:
        super().train(mode)
        self.inner.train(mode)
        return self

    @property
    def segments(self) -> list[Segment]:
        """The checkpoint segments (empty when the mode does not checkpoint)."""
        return list(self._segments)

    def _pin(self) -> bool:
        pin = self.memory.pin_memory
        return torch.cuda.is_available() if pin is None else bool(pin)

    def forward(self, x: Tensor) -> Tensor:
        """Same output as ``model(x)``; what autograd keeps depends on the mode."""
        cfg = self.memory
        if not torch.is_grad_enabled() or cfg.mode == "none":
            return self.inner(x)
        offload = (torch.autograd.graph.save_on_cpu(pin_memory=self._pin())
                   if cfg.offloads and x.device.type != "cpu" else contextlib.nullcontext())
        with offload:
            if not cfg.checkpoints:
                return self.inner(x)
            if self._units:
                with checkpointed(self._units):
                    return self.inner(x)
            if self._levels:
                return run_strips(self.inner.pipeline_layers(), self._levels, x,
                                  rows=cfg.strip_rows, cols=cfg.strip_cols)
            device, pin = x.device, self._pin()
            host = cfg.offloads and device.type != "cpu"
            return run_segments(
                self.inner.pipeline_layers(), self._segments, x,
                checkpoint_last=cfg.checkpoint_last,
                to_host=(lambda t: _ToHost.apply(t, pin)) if host else None,
                to_device=(lambda t: t.to(device, non_blocking=pin)) if host else None)

    def extra_repr(self) -> str:
        c = self.memory
        if self._units:
            return f"mode={c.mode}, granularity={c.granularity}, units={len(self._units)}"
        if self._levels:
            return f"mode={c.mode}, granularity=strips, levels={len(self._levels)}, " \
                   f"strip_rows={c.strip_rows}, strip_cols={c.strip_cols}"
        return (f"mode={c.mode}, granularity={c.granularity}, segments={len(self._segments)}"
                if c.checkpoints else f"mode={c.mode}")


_MODULE_STATE = set(vars(nn.Module()))  # training, _parameters ...: every module's own


def _forwarded(name: str) -> property:
    return property(lambda self: getattr(self.inner, name),
                    doc=f"The wrapped model's ``{name}``.")


def _wrapper_class(model: nn.Module) -> type[MemoryWrapped]:
    """:class:`MemoryWrapped` with the model's public members as class members.

    Python 3.12 checks a runtime protocol (the model contract, ``Footprinted`` ...) with
    ``inspect.getattr_static``, which does not see what ``__getattr__`` would return: a
    wrapper that only delegated would lose every capability of its model there.
    """
    names = {n for cls in type(model).__mro__ if cls not in nn.Module.__mro__
             for n in vars(cls)}
    names |= set(vars(model))
    own = set(dir(MemoryWrapped)) | _MODULE_STATE | {"inner", "memory"}  # the wrapper's own
    forwarded = sorted(n for n in names if not n.startswith("_") and n not in own)
    return cast(type[MemoryWrapped], type("MemoryWrapped", (MemoryWrapped,), {
        "__module__": __name__, "__qualname__": "MemoryWrapped",
        **{n: _forwarded(n) for n in forwarded}}))


def _by_units(model: nn.Module) -> bool:
    """Whether ``model`` is checkpointed by building block.

    It names its roots and has no flat layer form (smp networks; Gated-SCNN on a timm
    backbone).
    """
    if not isinstance(model, Checkpointable):
        return False
    if not isinstance(model, Pipelined):
        return True
    try:
        model.pipeline_layers()
    except ConfigError:
        return True
    return False


def _units_of(model: nn.Module, cfg: MemoryConfig) -> list[nn.Module]:
    """The building blocks to checkpoint (:mod:`seg_at_scale.memory.block_checkpoint`)."""
    name = type(model).__name__
    if cfg.granularity not in UNIT_GRANULARITIES:
        what = "recompute" if cfg.granularity == "strips" else "count"
        raise ConfigError(
            f"memory.granularity={cfg.granularity}: {name} has no flat layer form whose "
            f"layers {cfg.granularity} would {what}; use memory.granularity=level (stages) "
            "or memory.granularity=block (building blocks), both exact")
    roots = cast(Checkpointable, model).checkpoint_roots()  # called where _by_units(model)
    units = find_units(roots, cfg.granularity)
    if not cfg.checkpoint_last:
        units = units[:-1]  # the last one would be recomputed at once: same peak, more time
    if not units:
        log.warning("memory.granularity=%s finds no building block to checkpoint in %s: "
                    "nothing is checkpointed; use memory.granularity=block",
                    cfg.granularity, name)
    return units


def apply_memory_mode(model: nn.Module, cfg: MemoryConfig | str) -> nn.Module:
    """The model under a memory mode (``none`` returns the model itself).

    Args:
        model: any network; checkpointing needs ``model.pipeline_layers()`` or
            ``model.checkpoint_roots()``.
        cfg: a :class:`MemoryConfig` or just the mode name.

    Returns:
        A module with the model's parameters and state-dict keys.
    """
    cfg = MemoryConfig(cfg) if isinstance(cfg, str) else cfg
    if isinstance(model, MemoryWrapped):
        model = model.inner
    if cfg.mode == "none":
        return model
    return _wrapper_class(model)(model, cfg)


def memory_mode_of(model: nn.Module) -> MemoryConfig:
    """The memory mode a model runs under (``none`` for a plain model)."""
    cfg = getattr(model, "memory", None)
    return cfg if isinstance(cfg, MemoryConfig) else MemoryConfig("none")
