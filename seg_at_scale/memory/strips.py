"""Spatial checkpointing: a U-shaped network's levels recomputed in row strips.

Per-level checkpointing still holds one whole full-resolution level's activations while it
recomputes that level (~9 T for the U-Nets here, T = one full-resolution feature map of the
first level's width; the plain step holds ~15 T). ``memory.granularity=strips`` splits every
level that has a skip into row strips with a halo - what the tiling does for the whole
network - and keeps only the level's boundaries: its input, its pooled output, the tensor
it receives from the level below, its output, and their gradients. For level ``k`` with
encoder part ``E`` (ending in the skip), downsampling ``D``, the levels below ``inner`` and
decoder part ``T`` (from the upsampling to the level's output)::

    p = D(E(x))              strip by strip            (keeps x)
    u = inner(p)             the next level, the same way; the deepest runs plainly
    y = T(u, skip=E(x))      strip by strip, E again   (keeps x, u)

Backward: ``T`` recomputes each strip (``E`` too, for the skip), back-propagates the strip's
core rows, and accumulates the gradients of ``u`` and of the skip; after the levels below,
``E`` and ``D`` recompute each strip once more and back-propagate the pooled output's and
the skip's gradients together. At the first level the skip's gradient would be the largest
tensor of the step, so there ``T``'s backward goes on through ``E`` strip by strip instead
(one more backward of ``E``, no full-resolution gradient kept). A strip's window is its
core widened by a halo (the sum of the part's convolution radii, 2 rows for an
upsampling), so the core rows are computed exactly and each output row belongs to one
core: outputs and gradients equal the plain network's (up to float summation order). The
parts' parameters are explicit inputs of the two autograd functions, so each parameter's
gradient arrives once per backward pass (DDP counts on that).

Needs ``same`` padding, stride-1 convolutions inside the parts, no train-mode BatchNorm in
them (a strip's statistics are not the image's), and the flat form's level structure
(stash skip, downsample, ..., upsample, pop skip). Rows only: the width is never split.

>>> import torch
>>> from seg_at_scale.models import UNet
>>> net = UNet(in_channels=1, num_classes=2, levels=3, base_width=4, padding="same")
>>> layers = net.pipeline_layers()
>>> levels = find_levels(layers)
>>> [(lv.name, lv.halo_enc, lv.halo_top) for lv in levels]
[('skip0', 2, 6), ('skip1', 2, 6)]
>>> x = torch.randn(1, 1, 52, 20)
>>> torch.allclose(run_strips(layers, levels, x, rows=8), net(x), atol=1e-6)
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.memory.segments import _body, _is_down, _is_up
from seg_at_scale.models.layers import Skip, check_layers, run_layers

__all__ = ["Level", "find_levels", "run_strips", "DEFAULT_ROWS"]

DEFAULT_ROWS = 128  # rows per strip, at each level's own resolution


@dataclass(frozen=True)
class Level:
    """One stripped level of the flat layer list.

    Attributes:
        start: first layer of the encoder part ``E``.
        stash: the layer stashing the skip (last of ``E``).
        up: first layer of the decoder part ``T`` (the upsampling).
        stop: one past the last layer of ``T``.
        name: the skip's name.
        halo_enc: rows of context for ``D(E(x))`` (even).
        halo_top: rows of context for ``T(u, E(x))`` (even).
    """

    start: int
    stash: int
    up: int
    stop: int
    name: str
    halo_enc: int
    halo_top: int

    @property
    def down(self) -> int:
        return self.stash + 1


def _even(n: int) -> int:
    return n + n % 2


def _radius(layers: Sequence[nn.Module], where: str) -> int:
    """Rows of context of a run of same-resolution layers (conservative: radii add up)."""
    r = 0
    for layer in layers:
        for m in layer.modules():
            if isinstance(m, nn.ConvTranspose2d) or isinstance(m, nn.Upsample):
                r += 2  # one row at the lower resolution (bilinear), two here
            elif isinstance(m, nn.Conv2d):
                k, d, pad = m.kernel_size[0], m.dilation[0], m.padding
                same = pad == "same" or (isinstance(pad, tuple) and pad[0] == d * (k - 1) // 2)
                if m.stride[0] != 1 or not same:
                    raise ConfigError(
                        f"memory.granularity=strips needs stride-1, same-padded convolutions in "
                        f"{where}; found {m}: use memory.granularity=level for this model")
                r += d * (k - 1) // 2
    return r


def _down_radius(m: nn.Module, name: str) -> int:
    """Rows beyond a strip's core that a factor-2 downsampling of that core reads."""
    def first(v: Any) -> int:
        return int(v[0] if isinstance(v, tuple) else v)

    if not isinstance(m, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)) or isinstance(
            m, nn.ConvTranspose2d) or first(m.stride) != 2 or isinstance(m.padding, str):
        raise ConfigError(f"memory.granularity=strips: the downsampling after skip {name!r} "
                          f"is {m}; strips need a stride-2 pooling or convolution; use "
                          "memory.granularity=level")
    k, pad = first(m.kernel_size), first(m.padding)
    return max(pad, k - 2 - pad, 0)


def _check_part(layers: Sequence[nn.Module], name: str, where: str, *, up_first: bool) -> None:
    for i, layer in enumerate(layers):
        body = _body(layer)
        if _is_down(body) or (_is_up(body) and not (up_first and i == 0)):
            raise ConfigError(f"memory.granularity=strips: {where} changes resolution at "
                              f"{type(body).__name__}; use memory.granularity=level")
        if isinstance(layer, Skip) and set(layer.stash + layer.pop) - {name}:
            raise ConfigError(f"memory.granularity=strips: {where} carries skips other than "
                              f"{name!r}; use memory.granularity=level")


def find_levels(layers: Sequence[nn.Module]) -> list[Level]:
    """The nested levels of a U-shaped flat layer list, outermost first.

    Raises:
        ConfigError: the list is not U-shaped the way strips need (see the module doc).
    """
    check_layers(layers)
    levels: list[Level] = []
    start, stop = 0, len(layers)
    while True:
        stash = next((j for j in range(start, stop)
                      if isinstance(layers[j], Skip) and layers[j].stash), None)
        if stash is None:
            break
        names = layers[stash].stash
        if len(names) != 1 or stash + 1 >= stop or not _is_down(_body(layers[stash + 1])):
            raise ConfigError(
                f"memory.granularity=strips: layer {stash} stashes {list(names)} but is not "
                "followed by a downsampling layer; use memory.granularity=level")
        name = names[0]
        pop = next(j for j in range(stash + 1, stop)
                   if isinstance(layers[j], Skip) and name in layers[j].pop)
        up = max((j for j in range(stash + 2, pop) if _is_up(_body(layers[j]))), default=None)
        if up is None:
            raise ConfigError(f"memory.granularity=strips: no upsampling before skip {name!r} "
                              "is popped; use memory.granularity=level")
        enc, top = layers[start : stash + 1], layers[up:stop]
        _check_part(enc, name, f"the encoder of level {len(levels)}", up_first=False)
        _check_part(top, name, f"the decoder of level {len(levels)}", up_first=True)
        r_enc = _radius(enc, f"level {len(levels)}")
        r_down = _down_radius(_body(layers[stash + 1]), name)
        levels.append(Level(start, stash, up, stop, name, _even(r_enc + r_down),
                            _even(r_enc + _radius(top, f"level {len(levels)}"))))
        start, stop = stash + 2, up
    return levels


def _cores(n: int, rows: int) -> Iterator[tuple[int, int]]:
    for a in range(0, n, rows):
        yield a, min(n, a + rows)


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
    """One level's strip computations for one forward/backward pass."""

    def __init__(self, layers: Sequence[nn.Module], lv: Level, rows: int,
                 device: torch.device, *, through: bool = False) -> None:
        self.enc = list(layers[lv.start : lv.stash + 1])
        self.down = layers[lv.down]
        self.top = list(layers[lv.up : lv.stop])
        if getattr(_body(self.top[0]), "inplace", False):
            raise ConfigError("memory.granularity=strips: the upsampling works in place; "
                              "use memory.granularity=level")
        self.lv, self.rows = lv, rows
        self.enc_params = _params([*self.enc, self.down])
        # through: T's backward goes on through E (the skip's gradient is never stored whole)
        self.through = through
        self.top_params = _params(self.top) + (self.enc_params if through else [])
        self.autocast = _Autocast(device)
        self.grad_skip: Tensor | None = None

    def _skip(self, x: Tensor) -> Tensor:
        stash: dict[str, Tensor] = {}
        if getattr(_body(self.enc[0]), "inplace", False):
            x = x.clone()  # a window is a view of the level's kept input: never overwrite it
        run_layers(self.enc, x, stash)
        return stash[self.lv.name]

    def _window(self, a: int, b: int, n: int, halo: int) -> tuple[int, int]:
        return max(0, a - halo), min(n, b + halo)

    def enc_down(self, x: Tensor) -> Tensor:
        n, h, p = x.shape[-2], self.lv.halo_enc, None
        for a, b in _cores(n, self.rows):
            w0, w1 = self._window(a, b, n, h)
            pw = self.down(self._skip(x[..., w0:w1, :]))
            if p is None:
                p = _rows_like(pw, n // 2)
            p[..., a // 2 : b // 2, :] = pw[..., (a - w0) // 2 : (b - w0) // 2, :]
        assert p is not None
        return p

    def enc_down_backward(self, x: Tensor, grad_p: Tensor,
                          ) -> tuple[Tensor | None, list[Tensor | None]]:
        n, h = x.shape[-2], self.lv.halo_enc
        grad_x = torch.zeros_like(x) if x.requires_grad else None
        grad_skip, self.grad_skip = self.grad_skip, None
        acc: list[Tensor | None] = [None] * len(self.enc_params)
        for a, b in _cores(n, self.rows):
            w0, w1 = self._window(a, b, n, h)
            xw = x[..., w0:w1, :].detach().requires_grad_(x.requires_grad)
            with torch.enable_grad(), self.autocast():  # (the backward pass runs without)
                sw = self._skip(xw)
                outs = [self.down(sw)[..., (a - w0) // 2 : (b - w0) // 2, :]]
                grads = [grad_p[..., a // 2 : b // 2, :]]
                if grad_skip is not None:
                    outs.append(sw[..., a - w0 : b - w0, :])
                    grads.append(grad_skip[..., a:b, :])
            got = _grads(outs, grads, [xw] if grad_x is not None else [], self.enc_params, acc)
            if grad_x is not None and got[0] is not None:
                grad_x[..., w0:w1, :] += got[0]
        return grad_x, acc

    def top_fwd(self, x: Tensor, u: Tensor) -> Tensor:
        n, h, y = x.shape[-2], self.lv.halo_top, None
        for a, b in _cores(n, self.rows):
            w0, w1 = self._window(a, b, n, h)
            yw = run_layers(self.top, u[..., w0 // 2 : w1 // 2, :],
                            {self.lv.name: self._skip(x[..., w0:w1, :])})
            if y is None:
                y = _rows_like(yw, n)
            y[..., a:b, :] = yw[..., a - w0 : b - w0, :]
        assert y is not None
        return y

    def top_backward(self, x: Tensor, u: Tensor, grad_y: Tensor,
                     ) -> tuple[Tensor | None, Tensor, list[Tensor | None]]:
        n, h = x.shape[-2], self.lv.halo_top
        grad_u = torch.zeros_like(u)
        grad_x = torch.zeros_like(x) if self.through and x.requires_grad else None
        grad_skip: Tensor | None = None
        acc: list[Tensor | None] = [None] * len(self.top_params)
        for a, b in _cores(n, self.rows):
            w0, w1 = self._window(a, b, n, h)
            uw = u[..., w0 // 2 : w1 // 2, :].detach().requires_grad_()
            if self.through:
                xw = x[..., w0:w1, :].detach().requires_grad_(grad_x is not None)
                with torch.enable_grad(), self.autocast():
                    sw = self._skip(xw)
                inputs = [xw, uw] if grad_x is not None else [uw]
            else:
                with torch.no_grad(), self.autocast():
                    sw = self._skip(x[..., w0:w1, :])
                sw = sw.detach().requires_grad_()
                inputs = [sw, uw]
            with torch.enable_grad(), self.autocast():
                core = run_layers(self.top, uw, {self.lv.name: sw})[..., a - w0 : b - w0, :]
            got = _grads([core], [grad_y[..., a:b, :]], inputs, self.top_params, acc)
            g_u = got[-1]
            if g_u is not None:
                grad_u[..., w0 // 2 : w1 // 2, :] += g_u
            if self.through:
                if grad_x is not None and got[0] is not None:
                    grad_x[..., w0:w1, :] += got[0]
                continue
            if grad_skip is None:
                grad_skip = _rows_like(sw, n).zero_()
            if got[0] is not None:
                grad_skip[..., w0:w1, :] += got[0]
        self.grad_skip = grad_skip
        return grad_x, grad_u, acc


def _rows_like(t: Tensor, rows: int) -> Tensor:
    """An empty tensor like ``t`` with ``rows`` rows, in ``t``'s memory format.

    NHWC stays NHWC: the convolutions of the next strips and levels keep their fast layout.
    """
    out = t.new_empty((*t.shape[:-2], rows, t.shape[-1]))
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
            acc[i] = g if acc[i] is None else acc[i].add_(g)
    return list(got[: len(inputs)])


class _EncDown(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: _LevelRun, x: Tensor, *params: Tensor) -> Tensor:  # type: ignore[override]
        ctx.run = run
        ctx.save_for_backward(x)
        return run.enc_down(x)

    @staticmethod
    def backward(ctx: Any, grad_p: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        grad_x, grad_params = ctx.run.enc_down_backward(x, grad_p)
        return None, grad_x, *grad_params


class _Top(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: _LevelRun, x: Tensor, u: Tensor,  # type: ignore[override]
                *params: Tensor) -> Tensor:
        ctx.run = run
        ctx.save_for_backward(x, u)
        return run.top_fwd(x, u)

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
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
               rows: int = DEFAULT_ROWS) -> Tensor:
    """``run_layers(layers, x)``, with every level in ``levels`` computed in row strips.

    Args:
        layers: the flat layer list.
        levels: from :func:`find_levels`.
        x: input ``[B, C, H, W]``; H divisible by 2 per level (the model's alignment).
        rows: core rows per strip at each level's resolution (even).

    Raises:
        ConfigError: ``rows`` odd or < 2; train-mode BatchNorm in a stripped part.
    """
    if rows < 2 or rows % 2:
        raise ConfigError(f"memory.strip_rows={rows}: use an even number of rows >= 2")
    if torch.is_grad_enabled():
        for lv in levels:
            _check_norms([*layers[lv.start : lv.stash + 2], *layers[lv.up : lv.stop]])
    def level(k: int, x: Tensor) -> Tensor:
        if k == len(levels):
            lo, hi = (levels[-1].down + 1, levels[-1].up) if levels else (0, len(layers))
            return run_layers(layers[lo:hi], x)
        # level 0: no whole-resolution skip gradient kept (one more backward through E)
        run = _LevelRun(layers, levels[k], rows, x.device, through=k == 0)
        u = level(k + 1, _EncDown.apply(run, x, *run.enc_params))
        return _Top.apply(run, x, u, *run.top_params)

    return level(0, x)
