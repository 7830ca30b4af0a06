"""Plan a pipeline from a one-device profile: balance, stages k and micro-batches m.

The model of a step follows fairscale's GPipe schedule. Forward runs in clock cycles
``c = 0 .. m + k - 2``; in cycle ``c`` stage ``s`` runs micro-batch ``c - s``, stages on the
same device run one after another (one worker thread per device), and a cycle ends when
its slowest device is done. With k distinct devices and equal stages of time ``t`` that is
``(m + k - 1) t``: the ideal ``m t`` plus the bubble, a fraction ``(k - 1) / (m + k - 1)``.
Backward (with the recomputation that checkpointing adds) follows the same schedule in
reverse on accelerators; on CPU autograd runs it on one thread, one layer after another.

Memory per stage: parameters x (1 + 1 gradient + ``optimizer_states``) plus activations:
``never`` keeps all m micro-batches' saved tensors; ``always`` keeps m stage inputs plus one
micro-batch being recomputed; ``except_last`` keeps m - 1 inputs plus the last
micro-batch's saved tensors. Skips stashed in one stage and popped in a later one are held
for every micro-batch in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from seg_at_scale.errors import ConfigError
from seg_at_scale.parallel.profile import LayerCost

__all__ = ["StagePlan", "Plan", "bubble_fraction", "partition", "predict", "plan",
           "balance_by"]

GB = 1024**3


def bubble_fraction(k: int, m: int) -> float:
    """GPipe's idle fraction ``(k - 1) / (m + k - 1)``."""
    return (k - 1) / (m + k - 1)


@dataclass
class StagePlan:
    """One stage of a plan: its layers, device, times and peak memory."""

    layers: int
    device: str
    forward_s: float
    backward_s: float
    memory_bytes: int


@dataclass
class Plan:
    """A pipeline configuration and what the model predicts for it."""

    balance: list[int]
    devices: list[str]
    chunks: int
    checkpoint: str
    batch: int
    step_s: float
    bubble: float
    stages: list[StagePlan] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return max(s.memory_bytes for s in self.stages)

    @property
    def samples_per_s(self) -> float:
        return self.batch / self.step_s

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d.update(peak_gb=self.peak_bytes / GB, samples_per_s=self.samples_per_s)
        return d

    def table(self) -> str:
        """Human-readable plan (printed by ``pipeline=auto`` and the planner CLI)."""
        lines = [f"k={len(self.balance)} stages, m={self.chunks} micro-batches of "
                 f"{self.batch / self.chunks:g}, checkpoint {self.checkpoint}: step "
                 f"{self.step_s:.3f} s, {self.samples_per_s:.2f} samples/s, bubble "
                 f"{self.bubble:.1%}, balance {self.balance}"]
        for i, s in enumerate(self.stages):
            lines.append(f"  stage {i} on {s.device}: {s.layers:3d} layers, fwd "
                         f"{s.forward_s * 1e3:8.1f} ms, bwd {s.backward_s * 1e3:8.1f} ms, "
                         f"memory {s.memory_bytes / GB:7.2f} GB")
        return "\n".join(lines)


def _bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    out, a = [], 0
    for b in balance:
        out.append((a, a + b))
        a += b
    return out


def _stage_memory(costs: Sequence[LayerCost], a: int, b: int, m: int, scale: float,
                  checkpoint: str, optimizer_states: int) -> int:
    """Bytes held by stage ``[a, b)`` at its peak (see module docstring)."""
    params = sum(c.param_bytes for c in costs[a:b]) * (2 + optimizer_states)
    saved = sum(c.saved_bytes for c in costs[a:b]) * scale
    inp = (costs[a - 1].output_bytes if a > 0 else costs[0].output_bytes) * scale
    ckpt = {"always": m, "except_last": m - 1, "never": 0}[checkpoint]  # recomputed
    acts = saved * (m - ckpt) + inp * ckpt + (saved if ckpt else 0)
    # a checkpointed micro-batch still holds the skips its stage stashed
    cross = sum(c.stash_bytes for c in costs[a:b]) * scale * ckpt
    return int(params + acts + cross)


def predict(costs: Sequence[LayerCost], balance: Sequence[int], devices: Sequence[str],
            chunks: int, checkpoint: str = "except_last", batch: int | None = None,
            profiled_batch: int = 1, optimizer_states: int = 2) -> Plan:
    """Step time and per-stage memory of one pipeline configuration.

    Args:
        costs: per-layer profile measured with micro-batch ``profiled_batch``.
        balance: layers per stage.
        devices: one device per stage.
        chunks: micro-batches per step (m).
        checkpoint: Pipe's checkpoint mode.
        batch: samples per step (default ``chunks * profiled_batch``); costs scale linearly
            with the micro-batch size ``batch / chunks``.
        profiled_batch: samples in the profiled input.
        optimizer_states: per-parameter optimizer tensors (Adam: 2, SGD momentum: 1).
    """
    if sum(balance) != len(costs):
        raise ConfigError(f"balance {list(balance)} sums to {sum(balance)}, the profile has "
                          f"{len(costs)} layers")
    k, m = len(balance), chunks
    batch = batch or chunks * profiled_batch
    scale = batch / chunks / profiled_batch
    stages = []
    for s, (a, b) in enumerate(_bounds(balance)):
        f = sum(c.forward_s for c in costs[a:b]) * scale
        bw = sum(c.backward_s for c in costs[a:b]) * scale
        recompute = {"always": 1.0, "except_last": (m - 1) / m, "never": 0.0}[checkpoint]
        stages.append(StagePlan(b - a, str(devices[s]), f, bw + recompute * f,
                                _stage_memory(costs, a, b, m, scale, checkpoint,
                                              optimizer_states)))
    step = _schedule(stages, m, "forward_s") + _schedule(
        stages, m, "backward_s", serial=all(str(d).startswith("cpu") for d in devices))
    return Plan(list(balance), [str(d) for d in devices[:k]], m, checkpoint, batch, step,
                bubble_fraction(k, m), stages)


def _schedule(stages: Sequence[StagePlan], m: int, key: str, serial: bool = False) -> float:
    """Clock-cycle makespan: per cycle, each device runs its tasks back to back."""
    if serial:
        return m * sum(getattr(s, key) for s in stages)
    k = len(stages)
    total = 0.0
    for c in range(m + k - 1):
        busy: dict[str, float] = {}
        for s in range(max(0, c - m + 1), min(c, k - 1) + 1):
            busy[stages[s].device] = busy.get(stages[s].device, 0.0) + getattr(stages[s], key)
        total += max(busy.values())
    return total


def partition(weights: Sequence[float], k: int, *,
              fits: Callable[[int, int], bool] | None = None) -> list[int] | None:
    """Contiguous split of ``weights`` into ``k`` non-empty parts minimising the largest sum.

    ``fits(a, b)`` (optional) says whether layers ``[a, b)`` may form a stage (a memory
    cap); returns None when no split satisfies it.
    """
    n = len(weights)
    if not 1 <= k <= n:
        raise ConfigError(f"cannot split {n} layers into {k} stages; use 1..{n} stages")
    pre = [0.0]
    for w in weights:
        pre.append(pre[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for s in range(1, k + 1):
        for b in range(s, n - (k - s) + 1):
            for a in range(s - 1, b):
                if best[s - 1][a] == inf or (fits is not None and not fits(a, b)):
                    continue
                v = max(best[s - 1][a], pre[b] - pre[a])
                if v < best[s][b]:
                    best[s][b], cut[s][b] = v, a
    if best[k][n] == inf:
        return None
    bounds, b = [], n
    for s in range(k, 0, -1):
        a = cut[s][b]
        bounds.append(b - a)
        b = a
    return bounds[::-1]


def balance_by(costs: Sequence[LayerCost], k: int, by: str = "time") -> list[int]:
    """Balance ``k`` stages by measured ``time`` (fwd + bwd), ``memory`` or ``params``."""
    key = {"time": lambda c: c.forward_s + c.backward_s,
           "memory": lambda c: c.saved_bytes + 4 * c.param_bytes,
           "params": lambda c: c.param_bytes}
    if by not in key:
        raise ConfigError(f"pipeline.balance_by={by!r}: use one of {sorted(key)} or plan")
    out = partition([key[by](c) for c in costs], k)
    assert out is not None
    return out


def plan(costs: Sequence[LayerCost], devices: Sequence[str], batch: int, *,
         memory_cap_gb: float | None = None, chunks: Sequence[int] | None = None,
         checkpoints: Sequence[str] = ("except_last", "always", "never"),
         profiled_batch: int = 1, max_stages: int | None = None,
         optimizer_states: int = 2) -> Plan:
    """The fastest (k, m, balance, checkpoint) whose every stage fits ``memory_cap_gb``.

    For each candidate it balances time under the cap (stages over the cap are not
    allowed), predicts the step, and keeps the fastest. Raises :class:`ConfigError` when
    nothing fits.
    """
    cap = memory_cap_gb * GB if memory_cap_gb else float("inf")
    options = chunks or [m for m in (1, 2, 4, 8, 16, 32, 64) if m <= batch and batch % m == 0]
    best: Plan | None = None
    times = [c.forward_s + c.backward_s for c in costs]
    for k in range(1, min(len(devices), max_stages or len(devices), len(costs)) + 1):
        for m in options:
            scale = batch / m / profiled_batch
            for ck in checkpoints:
                def fits(a: int, b: int, m: int = m, ck: str = ck, sc: float = scale) -> bool:
                    return _stage_memory(costs, a, b, m, sc, ck, optimizer_states) <= cap
                bal = partition(times, k, fits=fits)
                if bal is None:
                    continue
                p = predict(costs, bal, devices[:k], m, ck, batch, profiled_batch,
                            optimizer_states)
                if p.peak_bytes <= cap and (best is None or p.step_s < best.step_s):
                    best = p
    if best is None:
        raise ConfigError(
            f"no pipeline of <= {len(devices)} stages fits {memory_cap_gb} GB per device for "
            f"a batch of {batch}; raise the cap, add devices, lower the batch or the tile size")
    return best
