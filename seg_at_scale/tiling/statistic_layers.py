"""Whole-image statistics inside a network, computed tile by tile (the *sites*).

A layer that averages over its whole input (DeepLab's ASPP image pooling, GroupNorm) is
not halo-tileable as it is: a tile sees its own statistic, not the whole image's
(``docs/design.md``, "Where exactness does not hold"). Such a layer is made a
:class:`StatisticSite`: it can

* **record**: hand its input to a recorder, which sums the pixels of the tile's *core*
  (at the layer's resolution) into float64 sums (:meth:`StatisticSite.sums`);
* **hold**: use a fixed statistic (:attr:`StatisticSite.fixed`) instead of its input's,
  so that, once the whole image's statistic is known, a tile computes exactly what the
  whole-image forward computes there.

Without a recorder or a fixed statistic a site is the layer it replaces (the untiled
reference). Sites can depend on each other (a GroupNorm after another): :func:`site_levels`
orders them into levels, each level's statistics needing only the levels before it; the
passes of :mod:`seg_at_scale.tiling.statistic_passes` compute one level per pass over the tiles.

>>> gn = GroupNormSite(2, 4)
>>> x = torch.randn(1, 4, 8, 8)
>>> gn.fixed = gn.statistic(gn.sums(x))
>>> torch.allclose(gn(x), torch.nn.functional.group_norm(x, 2, gn.weight, gn.bias), atol=1e-6)
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["StatisticSite", "GroupNormSite", "PooledMean", "statistic_sites", "site_levels",
           "Recorder"]

Recorder = Callable[["StatisticSite", Tensor], None]
"""Called by a recording site with its input ``[B, C, h, w]``."""


class StatisticSite(nn.Module):
    """A layer with a whole-image statistic (subclasses say which; see the module docstring).

    Attributes:
        fixed: the statistic to use instead of the input's (set by the passes), or None.
        recorder: called with the input before the layer computes, or None.
    """

    fixed: Tensor | None = None
    recorder: Recorder | None = None

    def sums(self, x: Tensor) -> Tensor:
        """Float64 sums over every pixel of ``x [B, C, h, w]`` (their last entry: counts)."""
        raise NotImplementedError

    def statistic(self, total: Tensor) -> Tensor:
        """The statistic from summed :meth:`sums` (differentiable)."""
        raise NotImplementedError

    def neutral(self) -> Tensor:
        """A statistic of the right shape for batch 1 (the halo probe holds it)."""
        raise NotImplementedError

    def hold_for_probe(self) -> None:
        """Use :meth:`neutral` from now on (called on the halo probe's copy)."""
        self.fixed = self.neutral().double()

    def observe(self, x: Tensor) -> Tensor | None:
        """The fixed statistic, or None after telling the recorder about ``x``."""
        if self.fixed is not None:
            return self.fixed
        if self.recorder is not None:
            self.recorder(self, x)
        return None


class GroupNormSite(nn.GroupNorm, StatisticSite):
    """``nn.GroupNorm`` whose per-sample, per-group mean and variance can be fixed.

    The statistic is ``[B, G, 2]`` (mean, biased variance) over the group's channels and
    all pixels, as GroupNorm normalises with.
    """

    def sums(self, x: Tensor) -> Tensor:
        g = x.double().reshape(x.shape[0], self.num_groups, -1)
        n = torch.full_like(g[..., 0], g.shape[-1])
        return torch.stack([g.sum(-1), (g * g).sum(-1), n], dim=-1)

    def statistic(self, total: Tensor) -> Tensor:
        mean = total[..., 0] / total[..., 2]
        var = (total[..., 1] / total[..., 2] - mean**2).clamp_min(0)
        return torch.stack([mean, var], dim=-1)

    def neutral(self) -> Tensor:
        return torch.tensor([0.0, 1.0]).expand(1, self.num_groups, 2).clone()

    def forward(self, x: Tensor) -> Tensor:
        stat = self.observe(x)
        if stat is None:
            if x.device.type == "cpu" and x.dim() == 4 and not x.is_contiguous() and \
                    x.is_contiguous(memory_format=torch.channels_last):
                # torch's channels-last kernel on the CPU is 25x further from the statistic
                # the passes use (3.5e-5 in the logits, labels flipped between q=1 and q=2)
                y = F.group_norm(x.contiguous(), self.num_groups, self.weight, self.bias,
                                 self.eps)
                return y.contiguous(memory_format=torch.channels_last)
            return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        b, c = x.shape[:2]
        dtype = torch.promote_types(x.dtype, torch.float32)
        stat = stat.to(dtype)
        g = x.to(dtype).reshape(b, self.num_groups, -1)
        g = (g - stat[..., :1]) * torch.rsqrt(stat[..., 1:] + self.eps)
        y = g.reshape(x.shape)
        if self.affine:
            y = y * self.weight.to(dtype).reshape(1, c, 1, 1) + self.bias.to(dtype).reshape(
                1, c, 1, 1)
        return y


class PooledMean(StatisticSite):
    """The mean over all pixels ``[B, C, 1, 1]`` (an image-level pooling), fixable."""

    def sums(self, x: Tensor) -> Tensor:
        s = x.double().sum(dim=(2, 3))
        return torch.stack([s, torch.full_like(s, x.shape[-2] * x.shape[-1])], dim=-1)

    def statistic(self, total: Tensor) -> Tensor:
        return (total[..., 0] / total[..., 1])[..., None, None]

    def neutral(self) -> Tensor:
        raise NotImplementedError  # the owner knows its channels

    def pooled(self, x: Tensor) -> Tensor:
        """``[B, C, 1, 1]``: the mean of ``x``, or the fixed statistic.

        The fixed statistic is one image's (``[1, C, 1, 1]``), shared by every tile of a batch.
        """
        stat = self.observe(x)
        if stat is None:
            return x.mean(dim=(2, 3), keepdim=True)
        return stat.to(x.dtype).expand(x.shape[0], -1, -1, -1)


def statistic_sites(model: nn.Module) -> list[tuple[str, StatisticSite]]:
    """``(name, site)`` of every statistic site of ``model``, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, StatisticSite)]


def site_levels(model: nn.Module, example: Tensor | list[Tensor]
                ) -> dict[StatisticSite, int]:
    """Level of every site that runs on ``example``: 1 + the deepest site it depends on.

    A site depends on another when its input is computed from the other's output (an
    autograd path between them, found on one small forward pass). Sites of one level can
    be computed in the same pass over the tiles.
    """
    # autograd finds the dependencies: also under no_grad or inference_mode (where every
    # site would silently come out level 1)
    with torch.inference_mode(False), torch.enable_grad():
        return _site_levels(model, example)


def _site_levels(model: nn.Module, example: Tensor | list[Tensor]
                 ) -> dict[StatisticSite, int]:
    sites = [m for _, m in statistic_sites(model)]
    seen: list[tuple[StatisticSite, Tensor, Tensor]] = []

    def hook(m: nn.Module, inp: tuple[Any, ...], out: Any) -> None:
        if isinstance(out, Tensor) and isinstance(inp[0], Tensor):
            seen.append((m, inp[0], out))  # type: ignore[arg-type]

    handles = [s.register_forward_hook(hook) for s in sites]
    was_training = model.training
    try:
        model.eval()
        if isinstance(example, list):  # a stage's windows (seg_at_scale.tiling.staged.stages)
            model([x.detach().clone().requires_grad_(True) for x in example])
        else:
            model(example.detach().clone().requires_grad_(True))
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    levels: dict[StatisticSite, int] = {}
    for k, (site, inp, _) in enumerate(seen):
        level = 1
        for before, _, out in seen[:k]:
            if before is site or not inp.requires_grad:
                continue
            (g,) = torch.autograd.grad(inp, out, torch.ones_like(inp), retain_graph=True,
                                       allow_unused=True)
            if g is not None:
                level = max(level, levels[before] + 1)
        levels[site] = max(level, levels.get(site, 0))
    return levels
