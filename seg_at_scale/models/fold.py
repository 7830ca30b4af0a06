"""Fold eval-mode BatchNorm into the convolution before it, for prediction.

An eval-mode BatchNorm is an affine map per channel. When its input is a convolution's
output that nothing else reads, it folds into that convolution's weight and bias
(:func:`torch.nn.utils.fusion.fuse_conv_bn_weights`, computed in float64 and rounded
once), and the BatchNorm becomes an identity (timm's ``BatchNormAct2d`` keeps its
activation). The network computes the same function with one pass over every feature map
fewer. On this project's CPU that gained 1.01-1.07x (``experiments/bench_fold.py``; eval
BatchNorm's 10-12 % of the profile mostly moves to the next operation's memory traffic),
so ``seg-predict`` folds only with ``fold_bn=true``.

Which pairs fold is found by running the network once, on a small input, not by reading
its code (smp's DeepLab and FPN do not trace with ``torch.fx``): a forward hook on each
convolution records its output, a pre-hook on each BatchNorm its input, and a dispatch
mode counts the operations that read each convolution's output. A pair folds when the
BatchNorm's input is that convolution's output, read by nothing else (not a residual, not
an in-place activation), and both modules ran once.

With ``fold_bn=true`` prediction folds the network it runs, so its tiled, staged and
whole-image forwards are one network and tiling stays exact; against the unfolded
network the logits differ by float rounding (about 1e-6 of the largest).

>>> import torch
>>> from torch import nn
>>> net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()).eval()
>>> folded, n = fold_batchnorm(net, torch.zeros(1, 2, 8, 8))
>>> n, type(folded[1]).__name__
(1, 'Identity')
>>> x = torch.randn(1, 2, 8, 8)
>>> bool(torch.allclose(folded(x), net(x), atol=1e-6))
True
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn.utils.fusion import fuse_conv_bn_weights
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["fold_batchnorm", "foldable_pairs"]


class _Reads(TorchDispatchMode):
    """Counts the operations that read each watched tensor."""

    def __init__(self, watched: dict[int, Any]) -> None:
        super().__init__()
        self.watched = watched
        self.reads: Counter[int] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs or {})):
            if isinstance(t, Tensor) and id(t) in self.watched:
                self.reads[id(t)] += 1
        return func(*args, **(kwargs or {}))


def _foldable_bn(m: nn.Module) -> bool:
    plain = type(m) is nn.BatchNorm2d
    act = isinstance(m, nn.BatchNorm2d) and hasattr(m, "act") and hasattr(m, "drop")
    return ((plain or act) and not m.training and m.running_mean is not None
            and m.running_var is not None)


def foldable_pairs(net: nn.Module, example: Tensor) -> list[tuple[str, str]]:
    """``(convolution, BatchNorm)`` names of every pair that folds (module docstring).

    Args:
        net: the network, in eval mode.
        example: an input it accepts, ``[1, C, H, W]`` (a small one: it runs once).
    """
    names = {id(m): n for n, m in net.named_modules(remove_duplicate=False)}
    outputs: dict[int, tuple[Tensor, str]] = {}  # the tensors stay alive: ids stay unique
    calls: Counter[str] = Counter()
    fed: dict[str, int] = {}  # BatchNorm -> id of its input

    def conv_hook(m: nn.Module, args: Any, out: Any) -> None:
        calls[names[id(m)]] += 1
        if isinstance(out, Tensor):
            outputs[id(out)] = (out, names[id(m)])

    def bn_hook(m: nn.Module, args: Any) -> None:
        calls[names[id(m)]] += 1
        fed[names[id(m)]] = id(args[0])

    hooks = [m.register_forward_hook(conv_hook) for m in net.modules()
             if isinstance(m, nn.Conv2d)]
    hooks += [m.register_forward_pre_hook(bn_hook) for m in net.modules() if _foldable_bn(m)]
    reads = _Reads(outputs)
    try:
        with torch.no_grad(), reads:
            net(example)
    finally:
        for h in hooks:
            h.remove()
    pairs = []
    for bn, src in fed.items():
        if src in outputs and reads.reads[src] == 1:
            conv = outputs[src][1]
            if calls[conv] == 1 and calls[bn] == 1:
                pairs.append((conv, bn))
    return pairs


def _set(net: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(net.get_submodule(parent) if parent else net, leaf, module)


def fold_batchnorm(net: nn.Module, example: Tensor) -> tuple[nn.Module, int]:
    """A copy of ``net`` with every foldable eval BatchNorm folded into its convolution.

    Args:
        net: the network, in eval mode (unchanged).
        example: a small input it accepts, ``[1, C, H, W]``.

    Returns:
        The folded copy (``net`` itself when nothing folds) and how many pairs folded.
    """
    pairs = foldable_pairs(net, example)
    if not pairs:
        return net, 0
    out = copy.deepcopy(net)
    shared = Counter(id(m) for _, m in out.named_modules(remove_duplicate=False))
    n = 0
    for conv_name, bn_name in pairs:
        # foldable_pairs: a Conv2d and a BatchNorm2d with running statistics (_foldable_bn)
        conv = cast(nn.Conv2d, out.get_submodule(conv_name))
        bn = cast(nn.BatchNorm2d, out.get_submodule(bn_name))
        if shared[id(conv)] > 1 or shared[id(bn)] > 1:
            continue  # one module under two names: folding one would change the other
        assert bn.running_mean is not None and bn.running_var is not None
        f64 = torch.float64
        bias = None if conv.bias is None else conv.bias.detach().to(f64)
        w, b = fuse_conv_bn_weights(
            conv.weight.detach().to(f64), bias, bn.running_mean.to(f64),
            bn.running_var.to(f64), bn.eps,
            None if bn.weight is None else bn.weight.detach().to(f64),
            None if bn.bias is None else bn.bias.detach().to(f64))
        fmt = (torch.channels_last if conv.weight.is_contiguous(
            memory_format=torch.channels_last) and not conv.weight.is_contiguous()
            else torch.contiguous_format)
        conv.weight = nn.Parameter(w.to(conv.weight.dtype).contiguous(memory_format=fmt),
                                   requires_grad=False)
        conv.bias = nn.Parameter(b.to(conv.weight.dtype), requires_grad=False)
        _set(out, bn_name, nn.Identity() if type(bn) is nn.BatchNorm2d
             else nn.Sequential(cast(nn.Module, bn.drop), cast(nn.Module, bn.act)))
        n += 1
    return out, n
