"""Receptive field and halo: analytic for the U-Net family, measured for any model.

The *halo* is the context a tile needs beyond its core when the core starts on the
pooling grid (a multiple of the downsampling factor ``align``): for every aligned block of
``align`` output pixels, how far the receptive fields of its pixels reach past the block.
It is smaller than the receptive-field radius of a single pixel (94 vs 107 for a five-level
same-padding U-Net): a pixel late in a block sees further back, but it is also further
from the block start. For valid-padding networks it is the context before the core, which
equals the per-side shrink (92 for the 2015 U-Net); the context after the core follows
from the size rule (``Footprint.out_residue``).

The empirical measurement back-propagates from one aligned block of ``align`` output
pixels near the middle, along each axis in turn (for same padding on a strip two blocks
wide, so a wide pretrained encoder probes fast), through a *structural copy* of the model:
weights made positive, activations replaced by the identity and max-pooling by average
pooling, in float64 and eval mode. That copy is linear with positive coefficients, so the
gradient is non-zero exactly on the receptive field (a ReLU that happens to be off, or a
max-pool that routes the gradient to one input, cannot hide part of it).

>>> from seg_at_scale.models import UNet
>>> net = UNet(in_channels=1, num_classes=2, levels=3, convs_per_level=2, base_width=2,
...            padding="valid")
>>> halo_width(net), empirical_halo(net)
(20, 20)
"""

from __future__ import annotations

import copy
import math
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.protocols import Capability
from seg_at_scale.tiling.geometry import Footprint

__all__ = ["Footprinted", "Aligned", "HeldForProbe", "alignment", "exact_alignment",
           "measured_alignment", "SHIFTS", "halo_width", "check_footprint", "footprint_misfit",
           "empirical_halo", "footprint", "WholeImageDependency", "structural_copy",
           "GLOBAL_SIZE"]

_ACTIVATIONS = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.ELU, nn.PReLU,
                nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Mish, nn.Softplus)


@runtime_checkable
class Footprinted(Capability, Protocol):
    """A network that states its footprint (every family of the model contract does)."""

    def footprint(self) -> Footprint: ...


@runtime_checkable
class Aligned(Capability, Protocol):
    """A network that states its alignment: the total downsampling factor."""

    @property
    def downsampling_factor(self) -> int: ...


@runtime_checkable
class HeldForProbe(Capability, Protocol):
    """A layer with a whole-image statistic that the halo probe holds constant.

    The project's statistic sites and Gated-SCNN's image pooling: tiled, their statistic
    comes from extra passes, so the probe measures the local receptive field around it.
    """

    def hold_for_probe(self) -> None: ...


def alignment(model: nn.Module) -> int:
    """``model.downsampling_factor`` where the network states it, else 1 (no pooling grid)."""
    return int(model.downsampling_factor) if isinstance(model, Aligned) else 1


def exact_alignment(model: nn.Module) -> int:
    """The alignment exact tiles start on: stated (``downsampling_factor``), else measured.

    A network that states none is probed (:func:`measured_alignment`): one that pools or
    strides without saying so was tiled on a grid its pooling does not follow (logits off
    by up to 1 at q=3 for one max-pool).
    """
    return alignment(model) if isinstance(model, Aligned) else measured_alignment(model)


#: the input shifts tried, smallest first: every pooling grid of common networks (2^k, 3 * 2^k)
SHIFTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@torch.no_grad()
def measured_alignment(model: nn.Module) -> int:
    """The smallest shift of the input (:data:`SHIFTS`) that shifts the output as much.

    Tiles whose origins are multiples of it see every pooling window as the whole image
    does. Measured on the probe's float64 copy (:func:`structural_copy`) on one random
    image and the same image shifted along both axes, compared away from the borders (past
    the receptive field of any one pixel, :func:`_measure`).

    Raises:
        ConfigError: no shift up to 64 pixels moves the output with the input (upsampling
            with ``align_corners=True``, layers that see pixel positions): no tiling of the
            network is exact.
    """
    # past the reach of any one pixel, which a block of 64 bounds (its halo, plus the 63
    # pixels a pixel lies past the block's start), probed on strips wide enough for any grid
    # tried (one pixel's strip would pool to nothing)
    reach = _measure(model, SHIFTS[-1])[0] + SHIFTS[-1]
    net = structural_copy(model)
    channels = int(getattr(model, "in_channels", 0)) or _first_conv_channels(net)
    n = _probe_size(model, -(-(2 * reach + 3 * SHIFTS[-1]) // SHIFTS[-1]) * SHIFTS[-1])
    g = torch.Generator().manual_seed(0)
    x = torch.rand(1, channels, n + SHIFTS[-1], n + SHIFTS[-1], dtype=torch.float64,
                   generator=g)
    y = net(x[..., :n, :n])
    shrink = (n - y.shape[-1]) // 2
    margin = 0 if shrink else reach  # same padding: the borders' reach left out
    scale = float(y.abs().max()) or 1.0
    for s in SHIFTS:  # along both axes at once: one forward per shift
        shifted = net(x[..., s : s + n, s : s + n])
        a, b = margin + s, y.shape[-1] - margin
        if b - a < 1:
            break
        if (shifted[..., a - s : b - s, a - s : b - s] - y[..., a:b, a:b]).abs().max() \
                <= 1e-9 * scale:
            return s
    raise ConfigError(f"{type(model).__name__}'s output does not move with its input by any "
                     f"shift up to {SHIFTS[-1]} pixels (upsampling with align_corners=True, "
                     "or layers that see pixel positions): no tiling of it is exact; "
                     "predict it untiled, or tile it approximately (method='blended')")


def footprint(model: nn.Module, *, align: int | None = None) -> Footprint:
    """The model's :class:`Footprint`, analytic when the model provides one.

    Models with a ``footprint()`` method (the U-Nets) answer analytically; any other model
    is measured (padding from a forward pass, halo by :func:`empirical_halo`).

    Args:
        model: any 2-D segmentation network ``[B, C, H, W] -> [B, K, H', W']``.
        align: downsampling factor; defaults to ``model.downsampling_factor``, else
            measured (:func:`exact_alignment`).
    """
    if isinstance(model, Footprinted):
        return model.footprint()
    a = align or exact_alignment(model)
    halo, shrink, out_size = _measure(model, a)
    if shrink == 0:
        return Footprint(halo, a, "same", 0)
    return Footprint(shrink, a, "valid", out_size % a)


def footprint_misfit(fp: Footprint, need: Footprint, *, exact: bool = True) -> str | None:
    """The first field of ``fp`` that would not tile a network of footprint ``need`` exactly.

    ``padding`` and ``out_residue`` must be the network's, ``align`` a multiple of its; the
    halo at least its own for same padding (more context is still exact) and its own for
    valid padding (the per-side shrink). ``exact=False``: the halo is the caller's choice
    (``tiling.exact=false``). None when ``fp`` fits. The one rule for a footprint given
    with a network: ``fp=`` (:func:`check_footprint`) and a model file's card.
    """
    if fp.padding != need.padding:
        return "padding"
    if fp.align % need.align:
        return "align"
    if fp.out_residue != need.out_residue:
        return "out_residue"
    if exact and (fp.halo < need.halo or (need.padding == "valid" and fp.halo != need.halo)):
        return "halo"
    return None


def check_footprint(model: nn.Module, fp: Footprint | None, where: str) -> None:
    """Refuse a footprint that would not tile a network stating its own exactly.

    That is :func:`footprint_misfit`'s rule. Networks without ``footprint()`` are taken at
    the caller's word (measuring them is a probe of seconds); ``fp=None`` is the network's
    own.
    """
    if fp is None or not isinstance(model, Footprinted):
        return
    need = model.footprint()
    if footprint_misfit(fp, need) is not None:
        same = need.padding == "same"
        want = (f"halo >= {need.halo}, align a multiple of {need.align}, padding 'same'" if same
                else f"halo {need.halo}, align a multiple of {need.align}, padding 'valid', "
                     f"out_residue {need.out_residue}")
        raise ConfigError(f"{where}: fp={fp} does not tile {type(model).__name__} exactly (its "
                          f"footprint is {need}): leave fp out (the network's own is used) or "
                          f"give {want}")


def halo_width(model: nn.Module, method: str = "auto") -> int:
    """Context (pixels per side) a tile needs so its core output is exact.

    Args:
        model: the network.
        method: ``"analytic"`` (needs ``model.footprint()``), ``"empirical"``, or
            ``"auto"`` (analytic when the model provides it).
    """
    if method == "empirical" or (method == "auto" and not isinstance(model, Footprinted)):
        return empirical_halo(model)
    if method not in ("auto", "analytic"):
        raise ValueError(f"method={method!r}: use 'auto', 'analytic' or 'empirical'")
    if not isinstance(model, Footprinted):
        raise ValueError(f"method='analytic' needs a network with footprint(); "
                         f"{type(model).__name__} has none: use method='empirical'")
    return model.footprint().halo


def empirical_halo(model: nn.Module, *, align: int | None = None) -> int:
    """Aligned halo measured by back-propagation (see module docstring).

    For ``valid`` padding, output pixel ``i`` is centred on input pixel ``i + shrink``.
    """
    a = align or exact_alignment(model)
    return _measure(model, a)[0]


def _is_activation(module: nn.Module) -> bool:
    """Pointwise activations (torch's, and timm's own classes), which the probe drops."""
    return isinstance(module, _ACTIVATIONS) or type(module).__module__.startswith(
        "timm.layers.activations")


def _pointwise_norm(module: nn.Module) -> bool:
    """A LayerNorm over the channels of one pixel (ConvNeXt): local, so the probe drops it."""
    return isinstance(module, nn.LayerNorm) and len(module.normalized_shape) == 1


def structural_copy(model: nn.Module) -> nn.Module:
    """The model as the probe runs it (float64 on the CPU, positive weights, statistics held).

    Activations and pointwise norms are dropped and max pooling becomes average pooling, so
    every tap inside the receptive field carries gradient.
    """
    net = copy.deepcopy(model).to("cpu", torch.float64).eval()  # a CUDA model's too
    for child in list(net.modules()):
        for attr, sub in list(child.named_children()):
            if _is_activation(sub) or _pointwise_norm(sub):
                setattr(child, attr, nn.Identity())
            elif isinstance(sub, nn.MaxPool2d):
                setattr(child, attr, nn.AvgPool2d(sub.kernel_size, sub.stride, sub.padding,
                                                  ceil_mode=sub.ceil_mode))
    with torch.no_grad():
        for p in net.parameters():  # positive; / sqrt(fan-in) keeps 100+ layers finite
            p.uniform_(0.5, 1.0)
            if p.dim() > 1:
                p.div_(math.sqrt(p[0].numel()))
        for buf_name, buf in net.named_buffers():
            if buf_name.endswith("running_mean"):
                buf.zero_()
            elif buf_name.endswith("running_var"):
                buf.fill_(1.0)
    for m in net.modules():  # whole-image statistics held constant (tiled in extra passes)
        if isinstance(m, HeldForProbe):
            m.hold_for_probe()
    return net


def _probe_size(model: nn.Module, size: int) -> int:
    fit = getattr(model, "valid_input_size", None)
    return int(fit(size)) if callable(fit) else size


GLOBAL_SIZE = 2048  # a receptive field spanning inputs this long is taken as whole-image


class WholeImageDependency(ConfigError):
    """The probe found output pixels that depend on the whole input."""


def _extent(net: nn.Module, x: Tensor, axis: int, align: int
            ) -> tuple[int, int, int, int] | None:
    """Back-propagate from one aligned block of outputs along ``axis`` (-2 rows, -1 cols).

    Returns ``(lo, hi, block start in the input frame, output length)``: the first and last
    input index along ``axis`` that the block's receptive fields reach; None when the
    output is shorter than three blocks (probe a larger input).
    """
    y = net(x)
    out, size = y.shape[axis], x.shape[axis]
    if out < 3 * align:
        return None
    shrink = (size - out) // 2
    i = out // 2 - out // 2 % align - align  # an aligned block near the middle
    seed = y.narrow(axis, i, align)
    (g,) = torch.autograd.grad(seed.sum(), x)
    if not bool(torch.isfinite(g).all()):
        raise ValueError("the halo probe overflowed (non-finite gradients in the model's "
                         "linearised copy); give the model a footprint() method that returns "
                         "its Footprint")
    dims = tuple(d for d in range(g.dim()) if d != g.dim() + axis)
    hit = g.abs().sum(dim=dims).nonzero().flatten()
    return int(hit[0]), int(hit[-1]), i + shrink, out


@torch.enable_grad()  # the probe back-propagates, also when called under no_grad / inference
def _measure(model: nn.Module, align: int, max_size: int = 4096) -> tuple[int, int, int]:
    """Returns (halo, shrink per side, output size of the probe).

    Same-padding networks are probed along one axis at a time on a narrow strip (the reach
    of local operations along rows does not depend on the width), which keeps the float64
    copy of a wide pretrained encoder fast; valid-padding networks on squares.

    Raises:
        WholeImageDependency: the receptive field spans the whole input at two sizes, the
            larger one at least ``GLOBAL_SIZE``.
    """
    net = structural_copy(model)
    channels = int(getattr(model, "in_channels", 0)) or _first_conv_channels(net)
    size = _probe_size(model, max(8 * align, 64))
    with torch.no_grad():
        probe = net(torch.ones(1, channels, size, size, dtype=torch.float64))
    shrink = (size - probe.shape[-1]) // 2
    narrow = 2 * align if shrink == 0 else None
    whole_before, before = False, size
    while True:
        left = right = 0
        touched, whole = False, True
        for axis in (-2, -1):
            shape = [size, size] if narrow is None else (
                [size, narrow] if axis == -2 else [narrow, size])
            x = torch.ones(1, channels, *shape, dtype=torch.float64, requires_grad=True)
            found = _extent(net, x, axis, align)
            if found is None:
                if size >= max_size:
                    raise ValueError(f"the probe's output is under {3 * align} pixels at "
                                     f"input {size}; is this a segmentation network?")
                break
            lo, hi, block, out = found
            n = shape[axis]
            touched = touched or lo == 0 or hi == n - 1
            whole = whole and lo == 0 and hi == n - 1
            left, right = max(left, block - lo), max(right, hi - (block + align - 1))
        else:
            # valid nets: the context after a core is set by the size rule (out_residue)
            halo = left if shrink > 0 else max(left, right)
            if whole and whole_before and size >= GLOBAL_SIZE:
                raise WholeImageDependency(
                    f"{type(model).__name__}'s output pixels depend on the whole input at "
                    f"{before} and {size} pixels (a whole-image statistic: global pooling, "
                    "squeeze-excitation, attention, or a norm over the image), so no tiling "
                    "of it is exact; predict it untiled, or tile it approximately "
                    "(method='blended')")
            if not touched or size >= max_size:
                return halo, shrink, out
            whole_before = whole
        before, size = size, _probe_size(model, 2 * size)


def _first_conv_channels(net: nn.Module) -> int:
    for m in net.modules():
        if isinstance(m, nn.Conv2d):
            return int(m.in_channels)
    raise ValueError("cannot infer the model's input channels; give it an in_channels attribute")


def describe(model: nn.Module) -> dict[str, Any]:
    """Footprint as a plain dict, for run configs and logs."""
    fp = footprint(model)
    return {"halo": fp.halo, "align": fp.align, "padding": fp.padding,
            "context": fp.context, "out_residue": fp.out_residue}
