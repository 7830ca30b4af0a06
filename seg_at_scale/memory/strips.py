"""Spatial checkpointing: a U-shaped network's levels recomputed block by block.

Per-level checkpointing still holds one whole full-resolution level's activations while it
recomputes that level (~9 T for the U-Nets here, T = one full-resolution feature map of the
first level's width; the plain step holds ~15 T). ``memory.granularity=strips`` splits every
level that has a skip into blocks (row strips, cut into columns on wide tiles) with a halo -
what the tiling does for the whole network - and keeps only the level's boundaries: its
input, its pooled output, the tensor it receives from the level below, its output, and
their gradients. For level ``k`` with encoder part ``E`` (ending in the skip), downsampling
``D``, the levels below ``inner`` and decoder part ``T`` (from the upsampling to the level's
output)::

    p = D(E(x))              block by block            (keeps x)
    u = inner(p)             the next level, the same way; the deepest runs plainly
    y = T(u, skip=E(x))      block by block, E again   (keeps x, u)

Backward: ``T`` recomputes each block (``E`` too, for the skip), back-propagates the block's
core, and accumulates the gradients of ``u`` and of the skip; after the levels below,
``E`` and ``D`` recompute each block once more and back-propagate the pooled output's and
the skip's gradients together. At the first level the skip's gradient would be the largest
tensor of the step, so there ``T``'s backward goes on through ``E`` block by block instead
(one more backward of ``E``, no full-resolution gradient kept). A block's window is its
core widened on every side by a halo (the sum of the part's convolution radii, 2 pixels for
an upsampling), so the core is computed exactly and each output pixel belongs to one
core: outputs and gradients equal the plain network's (up to float summation order). The
parts' parameters are explicit inputs of the two autograd functions, so each parameter's
gradient arrives once per backward pass (DDP counts on that).

Why blocks and not only row strips: a strip of a wide tile is a large tensor (128 rows of a
5344-wide level of 16 channels: 44 MB), past the CPU caches and past the size glibc's
allocator reuses (32 MiB), so every strip's tensors were mapped, page-faulted and unmapped
again; a 5344^2 step ran 1.3x slower per pixel than a 2432^2 one. Columns of ``cols``
pixels at the first level, halved per level (the channels double) but never fewer than
``rows``, keep a block's tensors about the same size at every level and every tile width.

Needs ``same`` padding, stride-1 convolutions inside the parts, no train-mode BatchNorm in
them (a block's statistics are not the image's), and the flat form's level structure
(stash skip, downsample, ..., upsample, pop skip).

>>> import torch
>>> from seg_at_scale.models import UNet
>>> net = UNet(in_channels=1, num_classes=2, levels=3, base_width=4, padding="same")
>>> layers = net.pipeline_layers()
>>> levels = find_levels(layers)
>>> x = torch.randn(1, 1, 52, 36)
>>> torch.allclose(run_strips(layers, levels, x, rows=8, cols=12), net(x), atol=1e-6)
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.memory.unet_levels import Box, Level, check_block_size, even, find_levels, spans
from seg_at_scale.models.layers import body_of, run_layers

__all__ = ["Level", "find_levels", "run_strips", "DEFAULT_ROWS", "DEFAULT_COLS"]

DEFAULT_ROWS = 128  # rows per block, at each level's own resolution
DEFAULT_COLS = 1024  # columns per block at the first level (halved per level, >= rows)


class _Autocast:
    """The autocast state of the forward pass, re-entered for the recomputations."""

    def __init__(self, device: torch.device) -> None:
        self.device = device.type
        self.enabled = torch.is_autocast_enabled(self.device)
        self.dtype = torch.get_autocast_dtype(self.device) if self.enabled else None

    def __call__(self) -> contextlib.AbstractContextManager[Any]:
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=self.dtype)


class _LevelRun:
    """One level's block computations for one forward/backward pass."""

    def __init__(self, layers: Sequence[nn.Module], lv: Level, rows: int, cols: int | None,
                 device: torch.device, *, through: bool = False) -> None:
        self.enc = list(layers[lv.start : lv.stash + 1])
        self.down = layers[lv.down]
        self.top = list(layers[lv.up : lv.stop])
        if getattr(body_of(self.top[0]), "inplace", False):
            raise ConfigError("memory.granularity=strips: the upsampling works in place; "
                              "use memory.granularity=level")
        self.lv, self.rows, self.cols = lv, rows, cols
        self.enc_params = _params([*self.enc, self.down])
        # through: T's backward goes on through E (the skip's gradient is never stored whole)
        self.through = through
        self.top_params = _params(self.top) + (self.enc_params if through else [])
        self.autocast = _Autocast(device)
        self.grad_skip: Tensor | None = None

    def _skip(self, x: Tensor) -> Tensor:
        stash: dict[str, Tensor] = {}
        if getattr(body_of(self.enc[0]), "inplace", False):
            x = x.clone()  # a window is a view of the level's kept input: never overwrite it
        run_layers(self.enc, x, stash)
        return stash[self.lv.name]

    def _blocks(self, x: Tensor, halo: int) -> Iterator[tuple[Box, Box]]:
        """(core, window) of every block of the level whose input is ``x``."""
        h, w = x.shape[-2:]
        cols = w if self.cols is None else self.cols
        for r0, r1 in spans(h, self.rows):
            for c0, c1 in spans(w, cols):
                core = Box(r0, r1, c0, c1)
                yield core, core.grow(halo, h, w)

    def enc_down(self, x: Tensor) -> Tensor:
        p = None
        for core, win in self._blocks(x, self.lv.halo_enc):
            pw = self.down(self._skip(win.of(x)))
            if p is None:
                p = _like(pw, x.shape[-2] // 2, x.shape[-1] // 2)
            core.half().of(p).copy_(core.within(win).half().of(pw))
        assert p is not None
        return p

    def enc_down_backward(self, x: Tensor, grad_p: Tensor,
                          ) -> tuple[Tensor | None, list[Tensor | None]]:
        grad_x = torch.zeros_like(x) if x.requires_grad else None
        grad_skip, self.grad_skip = self.grad_skip, None
        acc: list[Tensor | None] = [None] * len(self.enc_params)
        for core, win in self._blocks(x, self.lv.halo_enc):
            xw = win.of(x).detach().requires_grad_(x.requires_grad)
            inner = core.within(win)
            with torch.enable_grad(), self.autocast():  # (the backward pass runs without)
                sw = self._skip(xw)
                outs = [inner.half().of(self.down(sw))]
                grads = [core.half().of(grad_p)]
                if grad_skip is not None:
                    outs.append(inner.of(sw))
                    grads.append(core.of(grad_skip))
            got = _grads(outs, grads, [xw] if grad_x is not None else [], self.enc_params, acc)
            if grad_x is not None and got[0] is not None:
                win.of(grad_x).add_(got[0])
        return grad_x, acc

    def top_fwd(self, x: Tensor, u: Tensor) -> Tensor:
        y = None
        for core, win in self._blocks(x, self.lv.halo_top):
            yw = run_layers(self.top, win.half().of(u), {self.lv.name: self._skip(win.of(x))})
            if y is None:
                y = _like(yw, *x.shape[-2:])
            core.of(y).copy_(core.within(win).of(yw))
        assert y is not None
        return y

    def top_backward(self, x: Tensor, u: Tensor, grad_y: Tensor,
                     ) -> tuple[Tensor | None, Tensor, list[Tensor | None]]:
        grad_u = torch.zeros_like(u)
        grad_x = torch.zeros_like(x) if self.through and x.requires_grad else None
        grad_skip: Tensor | None = None
        acc: list[Tensor | None] = [None] * len(self.top_params)
        for core, win in self._blocks(x, self.lv.halo_top):
            uw = win.half().of(u).detach().requires_grad_()
            if self.through:
                xw = win.of(x).detach().requires_grad_(grad_x is not None)
                with torch.enable_grad(), self.autocast():
                    sw = self._skip(xw)
                inputs = [xw, uw] if grad_x is not None else [uw]
            else:
                with torch.no_grad(), self.autocast():
                    sw = self._skip(win.of(x))
                sw = sw.detach().requires_grad_()
                inputs = [sw, uw]
            with torch.enable_grad(), self.autocast():
                out = core.within(win).of(run_layers(self.top, uw, {self.lv.name: sw}))
            got = _grads([out], [core.of(grad_y)], inputs, self.top_params, acc)
            g_u = got[-1]
            if g_u is not None:
                win.half().of(grad_u).add_(g_u)
            if self.through:
                if grad_x is not None and got[0] is not None:
                    win.of(grad_x).add_(got[0])
                continue
            if grad_skip is None:
                grad_skip = _like(sw, *x.shape[-2:]).zero_()
            if got[0] is not None:
                win.of(grad_skip).add_(got[0])
        self.grad_skip = grad_skip
        return grad_x, grad_u, acc


def _like(t: Tensor, h: int, w: int) -> Tensor:
    """An empty tensor like ``t`` of ``h x w`` pixels, in ``t``'s memory format.

    NHWC stays NHWC: the convolutions of the next blocks and levels keep their fast layout.
    """
    out = t.new_empty((*t.shape[:-2], h, w))
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(
            memory_format=torch.channels_last):
        out = out.contiguous(memory_format=torch.channels_last)
    return out


def _params(layers: Sequence[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for layer in layers:
        for q in layer.parameters():
            if q.requires_grad:
                seen.setdefault(id(q), q)
    return list(seen.values())


def _grads(outs: list[Tensor], grads: list[Tensor], inputs: list[Tensor],
           params: list[nn.Parameter], acc: list[Tensor | None]) -> list[Tensor | None]:
    """Gradients of ``inputs`` (returned) and ``params`` (added into ``acc``) for one strip."""
    got = torch.autograd.grad(outs, [*inputs, *params], grads, allow_unused=True)
    for i, g in enumerate(got[len(inputs):]):
        if g is not None:
            held = acc[i]
            acc[i] = g if held is None else held.add_(g)
    return list(got[: len(inputs)])


class _EncDown(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: _LevelRun, x: Tensor, *params: Tensor) -> Tensor:
        ctx.run = run
        ctx.save_for_backward(x)
        return run.enc_down(x)

    @staticmethod
    def backward(ctx: Any, grad_p: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        grad_x, grad_params = ctx.run.enc_down_backward(x, grad_p)
        return None, grad_x, *grad_params


class _Top(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: _LevelRun, x: Tensor, u: Tensor,
                *params: Tensor) -> Tensor:
        ctx.run = run
        ctx.save_for_backward(x, u)
        return run.top_fwd(x, u)

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        x, u = ctx.saved_tensors
        grad_x, grad_u, grad_params = ctx.run.top_backward(x, u, grad_y)
        return None, grad_x, grad_u, *grad_params


def _check_norms(layers: Sequence[nn.Module]) -> None:
    for layer in layers:
        for m in layer.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
                raise ConfigError(
                    "memory.granularity=strips with train-mode BatchNorm: a strip's statistics "
                    "are not the image's; use model.batch_norm=false / norm=none, or "
                    "memory.granularity=level")


def run_strips(layers: Sequence[nn.Module], levels: Sequence[Level], x: Tensor, *,
               rows: int = DEFAULT_ROWS, cols: int | None = DEFAULT_COLS) -> Tensor:
    """``run_layers(layers, x)``, with every level in ``levels`` computed block by block.

    Args:
        layers: the flat layer list.
        levels: from :func:`find_levels`.
        x: input ``[B, C, H, W]``; H and W divisible by 2 per level (the model's alignment).
        rows: most core rows per block at each level's resolution (even).
        cols: most core columns per block at the first level; level ``k`` takes
            ``cols / 2^k`` but no fewer than ``rows``. ``None``: whole rows (strips).

    Raises:
        ConfigError: ``rows`` or ``cols`` odd or < 2; train-mode BatchNorm in a stripped part.
    """
    check_block_size(rows, cols)
    if torch.is_grad_enabled():
        for lv in levels:
            _check_norms([*layers[lv.start : lv.stash + 2], *layers[lv.up : lv.stop]])

    def level(k: int, x: Tensor) -> Tensor:
        if k == len(levels):
            lo, hi = (levels[-1].down + 1, levels[-1].up) if levels else (0, len(layers))
            return run_layers(layers[lo:hi], x)
        cols_k = None if cols is None else max(rows, even(cols >> k))
        # level 0: no whole-resolution skip gradient kept (one more backward through E)
        run = _LevelRun(layers, levels[k], rows, cols_k, x.device, through=k == 0)
        u = level(k + 1, _EncDown.apply(run, x, *run.enc_params))
        return _Top.apply(run, x, u, *run.top_params)

    return level(0, x)
