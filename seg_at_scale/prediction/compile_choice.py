"""``compile=auto``: ``torch.compile`` where it pays, and only where it gives the network's bits.

A compiled network fuses the element-wise work between its convolutions and plans its
memory (on the 2-core CPU here the demo U-Net's compiled forward matches the eager one's
best and varies far less: 1.07x best against best, 1.5x median against median, fp32), but
compiling costs seconds per input shape (7-12 s for that U-Net here the first time, 2-4 s
from inductor's on-disk cache), and nothing promises that a compiled kernel computes each
pixel as the eager one does. Tiled ==
untiled rests on every tile computing what the whole-image forward computes, so:

* **Checked per shape.** The first time a shape (and precision and layout) reaches the
  network in a process, the tile runs eagerly, then compiled, and the two outputs are
  compared bit for bit. Only a compiled forward equal to the eager one is used for that
  shape; one that differs (or fails to compile) is logged and the shape stays eager. So a
  compiled prediction writes the eager prediction's bytes, and the fingerprint does not
  name the compiler: an interrupted run resumes with or without it.
* **Where it pays** (``compile=auto``, the default). A shape is tried when the eager
  forwards this prediction has left of it would take at least :data:`TRIAL_S`; its next
  forwards alternate compiled and eager (:data:`TIMED` of each, every tile computed once),
  and the shape stays compiled only when the best compiled one is faster. What
  was measured (eager and compiled seconds per forward, the compile's seconds, equal or
  not) is kept per (network shape, device, torch, input shape, precision, layout) in
  ``compile.json`` beside :mod:`~.layout_choice`'s cache, and later predictions compile
  a shape that was tried when the forwards they have left save more than its compile
  costs. ``compile=true`` compiles every shape (still checked), ``false`` never.

Networks whose prediction fixes a whole-image statistic first (an image pool, GroupNorm
sites) run eagerly: the fixed value is module state a compiled graph would have to guard.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from filelock import FileLock
from torch import Tensor, nn

from seg_at_scale.prediction.layout_choice import (
    cache_path,
    network_text,
    read_cache,
    write_cache,
)
from seg_at_scale.tiling.statistic_passes import has_statistics
from seg_at_scale.tiling.statistics import uses_image_pool

__all__ = ["CheckedCompile", "TRIAL_S", "checked_network", "compiler", "CACHE_NAME", "reset"]

log = logging.getLogger(__name__)

#: an untried shape is compiled when the eager forwards left would take this long
TRIAL_S = 30.0
#: timed forwards of each kind (after the compile's) before a shape is decided
TIMED = 2
#: the cache file, beside ``layouts.json``
CACHE_NAME = "compile.json"


def compiler(model: nn.Module) -> Callable[[Tensor], Any]:
    """The compiled network: static shapes (one kernel set per shape, as checked)."""
    return torch.compile(model, dynamic=False)


@dataclass
class _Shape:
    """One input shape's state and its timed forwards.

    ``eager``, ``timing`` (compiled and eager forwards alternate, each timed) or
    ``compiled``.
    """

    state: str
    eager: list[float]
    compiled: list[float] = field(default_factory=list)
    settled: bool = True  # False: eager only because this prediction was too small

    @property
    def eager_s(self) -> float:
        """An eager forward's seconds: the best after the first (oneDNN warms up on it)."""
        return min(self.eager[1:] or self.eager)


class CheckedCompile:
    """The network's forward, compiled per input shape where checked equal (and faster).

    Call :meth:`expect` with the forwards a prediction will make per input shape
    (:func:`~seg_at_scale.tiling.engine.forward_shapes`) before it starts: ``auto`` weighs
    a shape's forwards against its compile's cost.
    """

    def __init__(self, model: nn.Module, mode: bool | Literal["auto"]) -> None:
        self.model, self.mode = model, mode
        self.broken = False  # a compile failed: no shape of this network is tried again
        self._compiled: Callable[[Tensor], Any] | None = None
        self._shapes: dict[str, _Shape] = {}
        self._left: Counter[tuple[int, ...]] = Counter()
        self._network = network_text(model)

    def expect(self, shapes: Counter[tuple[int, int, int]]) -> None:
        """The forwards the coming prediction makes per input shape ``(batch, h, w)``."""
        self._left = Counter(shapes)
        self._shapes = {k: v for k, v in self._shapes.items() if v.settled}  # weighed anew

    def __call__(self, x: Tensor) -> Any:
        self._left[_size(x)] -= 1
        key = self._key(x)
        shape = self._shapes.get(key)
        if shape is None:
            if self.broken:
                self._shapes[key] = _Shape("eager", [])
                return self.model(x)
            return self._first(x, key)
        if shape.state == "eager":
            return self.model(x)
        assert self._compiled is not None
        if shape.state == "compiled":
            return self._compiled(x)
        # timing: compiled and eager alternate (the same bits: each tile computed once)
        compiled = len(shape.compiled) < len(shape.eager)
        t0 = _now(x)
        y = self._compiled(x) if compiled else self.model(x)
        (shape.compiled if compiled else shape.eager).append(_now(x) - t0)
        if len(shape.compiled) >= TIMED and len(shape.eager) > TIMED:
            best = min(shape.compiled)
            shape.state = "compiled" if self.mode is True or best < shape.eager_s else "eager"
            self._record(key, compiled_s=best, eager_s=shape.eager_s)
            log.info("compile: %s on %s (%.1f ms compiled, %.1f ms eager)", shape.state,
                     self._describe(x), best * 1e3, shape.eager_s * 1e3)
        return y

    def _first(self, x: Tensor, key: str) -> Any:
        """A new shape: eagerly (the reference), then compiled and compared if worth it."""
        t0 = _now(x)
        y = self.model(x)
        eager_s = _now(x) - t0
        if not self._worth(key, eager_s, max(0, self._left[_size(x)])):
            self._shapes[key] = _Shape("eager", [eager_s], settled=False)
            return y
        if self._compiled is None:
            self._compiled = compiler(self.model)
        t0 = _now(x)
        _COMPILED[type(self.model).forward.__code__] += 1
        try:
            yc = self._compiled(x)
        except Exception as exc:  # no C++ compiler, an op dynamo cannot trace, ...
            self._shapes[key] = _Shape("eager", [eager_s])
            self._record(key, eager_s=eager_s, error=f"{type(exc).__name__}: {exc}"[:300])
            log.warning("compile=%s: compiling the network failed on %s (%s: %s); it runs "
                        "eagerly (compile=false skips the attempt)", self.mode,
                        self._describe(x), type(exc).__name__, str(exc).splitlines()[0][:200])
            self.broken = True  # nor the other shapes: the cause is rarely the shape
            return y
        compile_s = max(0.0, _now(x) - t0 - eager_s)
        equal = _equal(y, yc)
        self._shapes[key] = _Shape("timing" if equal else "eager", [eager_s])
        self._record(key, eager_s=eager_s, compile_s=compile_s, equal=equal)
        if not equal:
            log.warning("compile=%s: the compiled network's output on %s differs from the "
                        "eager network's; this shape runs eagerly (exactness first)",
                        self.mode, self._describe(x))
        return y

    def _worth(self, key: str, eager_s: float, left: int) -> bool:
        """Whether to compile this shape now, ``left`` forwards of it to come."""
        if not (self.mode is True or self._pays(key, eager_s, left)):
            return False
        import torch._dynamo  # on the first compile only: its import takes a second

        code = type(self.model).forward.__code__
        if _COMPILED[code] >= torch._dynamo.config.recompile_limit:
            # torch runs a forward past its limit of compiled variants eagerly, unasked:
            # no trial would measure a compiled forward
            log.info("compile: %s.forward has %d compiled shapes in this process, torch's "
                     "limit; this shape runs eagerly", type(self.model).__name__,
                     _COMPILED[code])
            return False
        return True

    def _pays(self, key: str, eager_s: float, left: int) -> bool:
        """``auto``: whether the forwards left of this shape can pay for its compile."""
        if left <= 0:
            return False
        seen = _read().get(self._cache_key(key))
        if seen is None or seen.get("compiled_s") is None:
            if seen is not None and (seen.get("error") or seen.get("equal") is False):
                return False
            return left * eager_s >= TRIAL_S  # untried: where it can pay
        if seen.get("error") or not seen.get("equal") or seen["compiled_s"] >= seen["eager_s"]:
            return False
        return bool(left * (seen["eager_s"] - seen["compiled_s"]) > seen["compile_s"])

    def _key(self, x: Tensor) -> str:
        dev = x.device.type
        amp = str(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else "fp32"
        fmt = "channels_last" if (x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(
            memory_format=torch.channels_last)) else "contiguous"
        return json.dumps([list(x.shape), str(x.dtype), amp, fmt])

    def entry_key(self, x: Tensor) -> str:
        """The cache entry of this network on inputs like ``x``."""
        return self._cache_key(self._key(x))

    def _describe(self, x: Tensor) -> str:
        return "input " + "x".join(str(s) for s in x.shape)

    def _cache_key(self, key: str) -> str:
        return hashlib.sha256(json.dumps([self._network, key]).encode()).hexdigest()[:32]

    def _record(self, key: str, **values: Any) -> None:
        """Merge ``values`` into this shape's entry of the cache (under its lock)."""
        path = cache_path(CACHE_NAME)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(path) + ".lock", timeout=600)
        except OSError:
            return
        with lock:
            known = read_cache(path, _valid)
            entry = known.setdefault(self._cache_key(key), {"shape": key})
            entry.update(values)
            write_cache(path, known)


def _valid(entry: Any) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("shape"), str)


def _read() -> dict[str, Any]:
    return read_cache(cache_path(CACHE_NAME), _valid)


def _size(x: Tensor) -> tuple[int, ...]:
    return (int(x.shape[0]), *(int(s) for s in x.shape[2:]))


def _now(x: Tensor) -> float:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    return time.perf_counter()


def _equal(a: Any, b: Any) -> bool:
    """Bit for bit: the same dtype, shape and values (NaN where NaN)."""
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and torch.equal(
        torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)))


#: one checked forward per network, kept across the scenes of an archive
_NETWORKS: weakref.WeakKeyDictionary[nn.Module, CheckedCompile] = weakref.WeakKeyDictionary()
#: shapes compiled in this process per forward's code (torch counts its variants so)
_COMPILED: Counter[Any] = Counter()


def reset() -> None:
    """Forget every compiled network and variant of this process (``torch._dynamo.reset``)."""
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
    _NETWORKS.clear()
    _COMPILED.clear()


def checked_network(model: nn.Module, mode: bool | Literal["auto"],
                    shapes: Counter[tuple[int, int, int]]) -> Callable[[Tensor], Any]:
    """What a prediction calls: ``model`` or its checked compile.

    ``shapes``: its forwards per input shape (:func:`~.engine.forward_shapes`).
    """
    if mode is False or uses_image_pool(model) or has_statistics(model):
        return model
    net = _NETWORKS.get(model)
    if net is None or net.mode != mode:
        net = _NETWORKS[model] = CheckedCompile(model, mode)
    net.expect(shapes)
    return net

