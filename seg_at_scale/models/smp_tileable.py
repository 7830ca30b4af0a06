"""What makes a segmentation-models-pytorch network exactly tileable, and what cannot.

:func:`make_exact` changes an smp model in place, keeping every state-dict key:

* **GroupNorm** (FPN's segmentation blocks) normalises over the whole image: it becomes a
  :class:`~seg_at_scale.tiling.statistic_layers.GroupNormSite` (statistics from extra passes);
* **ASPP image pooling** (DeepLabV3 / V3+) averages the whole image: a
  :class:`~seg_at_scale.tiling.statistic_layers.PooledMean` site (two-pass tiling, as Gated-SCNN's);
* **bilinear upsampling with** ``align_corners=True`` (smp's segmentation heads, DeepLabV3+
  and FPN decoders) maps output pixel ``i`` to input ``i (n - 1) / (s n - 1)``: the
  position depends on the image's size ``n``, so no tile can reproduce it. It becomes the
  translation-invariant ``align_corners=False`` (``(i + 1/2) / s - 1/2``). Both agree in the
  middle of an image and differ by at most ``3 / 8`` of an input pixel at its borders; a
  model trained in this project is trained with it. ``align_corners=True`` keeps smp's
  form, which exact tiling then refuses (``tiling.exact=false`` runs it).

:func:`non_local_modules` lists what no pass can fix (squeeze-excitation, attention,
adaptive pooling pyramids, instance / layer norms over the image): exact tiling refuses
such a model before any work, naming the module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from segmentation_models_pytorch.base.modules import Attention as SMPAttention
from segmentation_models_pytorch.decoders.deeplabv3.decoder import ASPP, ASPPPooling
from segmentation_models_pytorch.decoders.fpn.decoder import Conv3x3GNReLU
from torch import Tensor, nn

from seg_at_scale.tiling.layout import SharedNCHW
from seg_at_scale.tiling.statistic_layers import GroupNormSite, PooledMean

__all__ = ["make_exact", "non_local_modules", "ASPPImagePool", "refusal", "skip_non_local",
           "pooling_first"]

_SQUEEZE = re.compile(r"SqueezeExcit|SEModule|SELayer|EffectiveSE|EcaModule|CecaModule|"
                      r"CbamModule|LightCbam|GatherExcite|SCSE|SelectiveKernel|GlobalContext|"
                      r"GlobalResponseNorm|SplitAttn")
_ATTENTION = re.compile(r"Attention|Attn|MultiheadAttention")
_IMAGE_NORM = re.compile(r"EvoNorm2dS|FilterResponseNorm")


class ASPPImagePool(ASPPPooling, PooledMean):
    """smp's ASPP image pooling with the mean as a fixable :class:`PooledMean` site."""

    def neutral(self) -> Tensor:
        return torch.zeros(1, self[1].in_channels, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        size = x.shape[-2:]
        p = self.pooled(x)
        mod: nn.Module
        for mod in list(self)[1:]:
            p = mod(p)
        return F.interpolate(p, size=size, mode="bilinear", align_corners=False)


class _PoolingFirst(ASPP):
    """smp's ASPP with its image pooling computed first (the same output).

    A statistic pass stops at the pooling, so it no longer computes the four convolution
    branches before it.
    """

    def forward(self, x: Tensor) -> Tensor:
        return self.project(torch.cat(pooling_first(self.convs, x), dim=1))


def pooling_first(branches: Iterable[nn.Module], x: Tensor) -> list[Tensor]:
    """Each ASPP branch on ``x``, in order; the image pooling computed before the others."""
    mods = list(branches)
    order = sorted(range(len(mods)), key=lambda i: not isinstance(mods[i], PooledMean))
    src = SharedNCHW(x)  # the separable branches computing in NCHW share one copy of x
    out = {i: src.run(mods[i]) for i in order}
    return [out[i] for i in range(len(mods))]


class _FPNBlock(Conv3x3GNReLU):
    """FPN's conv-GN-ReLU whose upsampling follows ``align_corners`` (set by make_exact)."""

    align_corners: bool = False

    def forward(self, x: Tensor) -> Tensor:
        x = self.block(x)
        if self.upsample:
            x = F.interpolate(x, scale_factor=2.0, mode="bilinear",
                              align_corners=self.align_corners)
        return x


def make_exact(net: nn.Module, *, align_corners: bool = False) -> int:
    """Turn whole-image statistics into sites and, unless asked, fix the upsampling.

    Args:
        net: an smp model (changed in place; parameters and keys unchanged).
        align_corners: keep smp's size-dependent ``align_corners=True`` upsampling.

    Returns:
        How many of smp's ``align_corners=True`` upsamplings now run otherwise (0 when
        ``align_corners`` keeps them, or the architecture has none).
    """
    changed = 0
    for m in net.modules():
        if type(m) is nn.GroupNorm:
            m.__class__ = GroupNormSite
        elif type(m) is ASPPPooling:
            m.__class__ = ASPPImagePool
        elif type(m) is ASPP:
            m.__class__ = _PoolingFirst
        elif type(m) is Conv3x3GNReLU:
            m.__class__ = _FPNBlock
            cast(_FPNBlock, m).align_corners = align_corners
            changed += int(bool(m.upsample) and not align_corners)
        elif isinstance(m, nn.Upsample) and m.mode == "bilinear" and m.align_corners:
            m.align_corners = align_corners
            changed += int(not align_corners)
    return changed


def non_local_modules(net: nn.Module) -> list[tuple[str, str]]:
    """``(module name, what it does)`` for every operation that needs the whole input.

    Sites (:mod:`seg_at_scale.tiling.statistic_layers`) are not listed: the passes tile them
    exactly.
    """
    found: list[tuple[str, str]] = []
    skip: list[str] = []
    for name, m in net.named_modules():
        if any(name.startswith(s + ".") for s in skip):
            continue
        if isinstance(m, PooledMean | GroupNormSite):
            skip.append(name)  # tiled by the passes, its pooling included
            continue
        kind = _kind(m)
        if kind:
            found.append((name, kind))
            skip.append(name)  # report a block once, not its parts
    return found


def _kind(m: nn.Module) -> str | None:
    cls = type(m).__name__
    if isinstance(m, SMPAttention):  # smp's decoder slot: Identity unless scse (a child)
        return None
    if _SQUEEZE.search(cls) or getattr(m, "has_se", False) or hasattr(m, "_se_reduce"):
        return "squeeze-excitation (a gate from the mean over the whole input)"
    if isinstance(m, nn.MultiheadAttention) or _ATTENTION.search(cls):
        return "attention (every pixel attends to the whole input)"
    if isinstance(m, nn.GroupNorm | nn.modules.instancenorm._InstanceNorm) or \
            _IMAGE_NORM.search(cls):
        return f"{cls} (normalises over the whole input)"
    if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) > 1:
        return "LayerNorm over the image (normalises over the whole input)"
    if isinstance(m, nn.AdaptiveAvgPool2d | nn.AdaptiveMaxPool2d) or "AdaptivePool" in cls:
        return "adaptive pooling (averages regions of the whole input)"
    if isinstance(m, _FPNBlock) and m.upsample and m.align_corners or isinstance(
            m, nn.Upsample) and m.mode == "bilinear" and m.align_corners:
        return _CORNERS
    return None


_CORNERS = "bilinear upsampling with align_corners=True (positions depend on the size)"


def skip_non_local(net: nn.Module, x: Tensor) -> list[str]:
    """For ``tiling.exact=false``'s probe: ``net`` (a copy) with its local operations only.

    Upsampling takes the translation-invariant form (same reach); squeeze-excitation inside
    a block (smp's EfficientNet ``MBConvBlock``) is switched off, the block kept; any other
    non-local module becomes the identity where its output has its input's shape (``x``
    [B, C, H, W] shows the shapes). Returns the modules left in place.
    """
    for m in net.modules():
        if isinstance(m, _FPNBlock) or isinstance(m, nn.Upsample) and m.mode == "bilinear":
            m.align_corners = False
    found = [name for name, _ in non_local_modules(net)]
    shapes: dict[str, bool] = {}

    def note(name: str) -> Any:
        def hook(_m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            shapes.setdefault(name, _same_shape(args, out))
        return hook

    hooks = [net.get_submodule(n).register_forward_hook(note(n)) for n in found]
    try:
        with torch.no_grad():
            net(x)
    finally:
        for h in hooks:
            h.remove()
    left = []
    for name in found:
        m = net.get_submodule(name)
        if hasattr(m, "_se_reduce"):  # smp's MBConvBlock: SE is a branch inside the block
            block: Any = m  # a flag of the untyped block, not a submodule
            block._has_se = False
        elif shapes.get(name, False):
            parent, _, attr = name.rpartition(".")
            setattr(net.get_submodule(parent) if parent else net, attr, _Pass())
        else:
            left.append(name)
    return left


def _same_shape(args: tuple[Any, ...], out: Any) -> bool:
    return bool(args) and isinstance(args[0], Tensor) and isinstance(out, Tensor) and \
        out.shape == args[0].shape


class _Pass(nn.Module):
    """The identity for any call signature (stands in for a non-local module)."""

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return x


def refusal(where: str, found: list[tuple[str, str]]) -> str:
    """The one-line refusal of exact tiling: the module, why, and the fixes."""
    name, kind = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    fixes = []
    if any(k != _CORNERS for _, k in found):
        fixes.append("use a local encoder/architecture (e.g. model.encoder=resnet34 or "
                     "tu-convnext_tiny; Unet, FPN, DeepLabV3Plus)")
    if any(k == _CORNERS for _, k in found):
        fixes.append("set model.align_corners=false (size-invariant upsampling)")
    return (f"{where}: {name} is {kind}{more}, so no tiling reproduces the whole-image "
            f"result; {' and '.join(fixes)}, or tiling.exact=false (approximate: "
            "overlapping tiles with the halo the network has without those modules, or two "
            "alignment steps where it still needs the whole image; tiling.halo= widens it; "
            "each tile's centre kept)")
