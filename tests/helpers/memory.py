"""Shared pieces of the memory-mode tests: tiny models, gradients, the mode matrix."""


from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from seg_at_scale.memory import (
    MODES,
    MemoryConfig,
)
from seg_at_scale.models import UNet

CONF = str(Path(__file__).resolve().parents[2] / "seg_at_scale" / "conf")
CONFIGS = [MemoryConfig(m, granularity=g, every=3)
           for m in MODES if m != "none" for g in ("level", "block", "layers")
           if g == "level" or "checkpoint" in m]
CONFIGS.append(MemoryConfig("checkpoint", granularity="strips", strip_rows=6))  # 6 rows: many
# blocks: 10 columns at the first level (6 at the second: never fewer than the rows)
CONFIGS.append(MemoryConfig("checkpoint", granularity="strips", strip_rows=6, strip_cols=10))


def tiny(padding: str = "same", levels: int = 3) -> UNet:
    torch.manual_seed(0)
    return UNet(in_channels=3, num_classes=4, levels=levels, convs_per_level=2, base_width=4,
                padding=padding)


def saved_bytes(run: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd saves for the backward pass while ``run()``."""
    held: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(held.values())


def grads(net: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in net.parameters()]


def assert_close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float = 1e-5) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x - y).abs().max().item() <= tol * max(1.0, y.abs().max().item())


