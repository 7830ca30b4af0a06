"""The one public entry for predicting a tensor tiled: :func:`infer`.

In the shape of MONAI's ``sliding_window_inference``: one call, the options as arguments.
It picks how to compute from what the network can do, and never computes something
inexact unless asked for by name:

* no ``q`` / ``tile_size``: the network once over the whole (extended) image;
* a network without whole-image statistics: halo tiles, cores kept (exact);
* a network with statistic sites (GroupNorm, DeepLab's image pooling made exact by the
  project): statistic passes over the tiles first, then the tiles (exact);
* a network pooling over its whole input by the two-pass protocol (Gated-SCNN): the pooled
  features over the tiles first, then the tiles (exact);
* ``method="blended"``: Gaussian-weighted overlapping windows, as MONAI does: *not* exact,
  for networks that cannot be tiled exactly; never chosen by ``auto``.

What a network cannot do exactly is refused in one line naming the layer and the fix.

>>> from seg_at_scale.models import UNet
>>> net = UNet(in_channels=2, num_classes=3, levels=3, base_width=4, padding="same").eval()
>>> x = torch.randn(1, 2, 75, 61)
>>> torch.allclose(infer(net, x, q=2), infer(net, x), atol=1e-5)
True
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from seg_at_scale.devices import module_device
from seg_at_scale.errors import ConfigError
from seg_at_scale.tiling.auto_tile import auto_side
from seg_at_scale.tiling.blend import predict_blended
from seg_at_scale.tiling.geometry import Footprint
from seg_at_scale.tiling.halo import WholeImageDependency, check_footprint
from seg_at_scale.tiling.halo import footprint as model_footprint
from seg_at_scale.tiling.predict import (
    check_image,
    predict_full,
    predict_full_tta,
    predict_tiled,
    refuse_training_norms,
)
from seg_at_scale.tiling.statistic_layers import StatisticSite
from seg_at_scale.tiling.statistic_passes import has_statistics, predict_tiled_exact
from seg_at_scale.tiling.statistics import ImagePooled, predict_tiled_two_pass, uses_image_pool
from seg_at_scale.tiling.tile_sides import covering_side

__all__ = ["infer", "Method", "METHODS", "choose_method", "refuse_inexact_layers"]

Method = Literal["auto", "untiled", "tiled", "passes", "two_pass", "blended"]
METHODS: tuple[str, ...] = ("auto", "untiled", "tiled", "passes", "two_pass", "blended")

#: layers whose output depends on the whole input they see, with no exact tiled form here
_WHOLE_INPUT = (nn.GroupNorm, nn.InstanceNorm2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)


def refuse_inexact_layers(model: nn.Module) -> None:
    """Refuse a network that would see each tile's statistics instead of the image's.

    Train-mode BatchNorm, and GroupNorm / InstanceNorm / adaptive pooling that the project
    has not made statistic sites (:func:`whole_input_layer`), compute over the tile they are
    given: tiled,
    they differ from the whole-image forward. (Statistic sites are subclasses of these layers
    that the passes fix; they are allowed.)

    Raises:
        ConfigError: naming the first such layer and the fix.
    """
    refuse_training_norms(model, "infer")
    found = whole_input_layer(model)
    if found is not None:
        name, m = found
        raise ConfigError(
            f"infer: {name or 'the model'} ({type(m).__name__}) computes over the whole "
            "input it sees, so tiles would not equal the whole image; predict it untiled "
            "(no q / tile_size), or method='blended' for an approximation")


#: the footprint of a network that computes over its whole input: the image as it is, unpadded
AS_IS = Footprint(halo=0, align=1, padding="same", out_residue=0)


def _untiled_footprint(model: nn.Module) -> Footprint:
    """The footprint the untiled forward extends the image by.

    :data:`AS_IS` for a network that computes over its whole input (it has none), else the
    network's.
    """
    if whole_input_layer(model) is not None:
        return AS_IS  # known from its layers: no probe
    try:
        return model_footprint(model)
    except WholeImageDependency:  # found by the probe (a functional mean, attention)
        return AS_IS


def whole_input_layer(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The first layer computing over the whole input it sees that no statistic pass fixes.

    GroupNorm, InstanceNorm and adaptive pooling that are not the project's statistic
    sites (or parts of one); None when there is none.
    """
    sites = [n for n, m in model.named_modules() if isinstance(m, StatisticSite)]
    for name, m in model.named_modules():
        if any(name == s or name.startswith(s + ".") for s in sites):
            continue  # a site and its parts: the passes fix its statistic
        if isinstance(m, _WHOLE_INPUT):
            return name, m
    return None


def choose_method(model: nn.Module, *, tiled: bool) -> str:
    """The exact method ``auto`` takes for ``model`` (``tiled``: a grid was asked for)."""
    if not tiled:
        return "untiled"
    if has_statistics(model):  # sites first: their passes also cover a pooling site
        return "passes"
    if uses_image_pool(model):
        return "two_pass"
    return "tiled"


@torch.no_grad()
def infer(model: nn.Module, image: Tensor, *, method: Method = "auto",
          q: int | tuple[int, int] | None = None,
          tile_size: int | tuple[int, int] | Literal["auto"] | None = None,
          overlap: float = 0.25,
          fp: Footprint | None = None, autocast: torch.dtype | None = None,
          channels_last: bool = False, tta: str | None = None,
          out_dtype: torch.dtype = torch.float32) -> Tensor:
    """Logits of ``model`` over ``image``, tiled as asked and exactly the untiled ones.

    Args:
        model: the network, in eval mode.
        image: ``[B, C, H, W]`` (or ``[C, H, W]``), already normalised, on any device: the
            network runs on its own (tiles, or the whole image, copied there as needed).
        method: ``auto`` (the exact method the network allows; the default), or one by
            name: ``untiled``, ``tiled``, ``passes``, ``two_pass``, ``blended`` (inexact).
        q: tiles per side, or
        tile_size: the largest input window of a tile (``blended``: the window), or
            ``auto``: the largest the device's memory holds for this network, or none
            (untiled) when the whole image fits (:mod:`seg_at_scale.tiling.auto_tile`).
        overlap: ``blended`` only: the fraction of a window shared with its neighbour.
        fp: the footprint; computed from the network when omitted.
        autocast: run under ``torch.autocast`` with this dtype (the fast path; not bit-exact).
        channels_last: tiles in NHWC (give the model channels-last weights too).
        tta: ``flips`` or ``d4``: the mean softmax over those views instead of logits
            (``untiled`` and ``tiled`` only).
        out_dtype: the dtype of the result.

    Returns:
        ``[B, K, H, W]`` logits (TTA: probabilities); ``[K, H, W]`` for an unbatched input;
        on the image's device whatever the method (``tile_size=auto`` may or may not tile).

    Raises:
        ConfigError: an unknown method, a method the network cannot run exactly, or options
            the method does not take; one line each.
    """
    if method not in METHODS:
        raise ConfigError(f"infer: method={method!r} is not one of {', '.join(METHODS)}")
    refuse_training_norms(model, "infer")  # also untiled: its running statistics would move
    check_image(model, image, "infer", autocast)
    x = image if image.dim() == 4 else image[None]
    if tile_size == "auto":
        tile_size = None if q is not None else _auto_side(model, x, fp, autocast, channels_last)
    tiled = q is not None or tile_size is not None
    chosen = choose_method(model, tiled=tiled) if method == "auto" else method
    if chosen != "untiled" and not tiled:
        raise ConfigError(f"infer: method={chosen!r} tiles the image: give q or tile_size")
    out = _run(chosen, model, x, q=q, tile_size=tile_size, overlap=overlap, fp=fp,
               autocast=autocast, channels_last=channels_last, tta=tta, out_dtype=out_dtype)
    return out if image.dim() == 4 else out[0]


def _auto_side(model: nn.Module, x: Tensor, fp: Footprint | None,
               autocast: torch.dtype | None, channels_last: bool) -> int | None:
    """``tile_size=auto``: the side the device's memory holds, None when the image fits."""
    fp = fp or model_footprint(model)
    height, width = x.shape[-2:]
    side = auto_side(model, fp, height, width, x.shape[1], autocast=autocast,
                     channels_last=channels_last, batch=x.shape[0])
    return None if side >= covering_side(fp, height, width) else side


def _run(chosen: str, model: nn.Module, x: Tensor, *, q: int | tuple[int, int] | None,
         tile_size: int | tuple[int, int] | None, overlap: float, fp: Footprint | None,
         autocast: torch.dtype | None, channels_last: bool, tta: str | None,
         out_dtype: torch.dtype) -> Tensor:
    """``chosen`` on the batched ``x [B, C, H, W]`` (see :func:`infer`)."""
    if chosen == "blended":
        if not isinstance(tile_size, int) or tta is not None:
            raise ConfigError("infer: method='blended' takes one int tile_size (the window) "
                              "and no tta")
        if (fp or model_footprint(model)).padding != "same":
            raise ConfigError("infer: method='blended' needs a same-padding network (a valid "
                              "one's windows shrink); use method='auto'")
        return predict_blended(model, x, window=tile_size, overlap=overlap, autocast=autocast,
                               channels_last=channels_last, out_dtype=out_dtype)
    if chosen in ("passes", "two_pass") and tta is not None:
        raise ConfigError(f"infer: tta={tta!r} with method={chosen!r}: each view would need "
                          "its own whole-image statistics; predict without tta")
    if chosen == "untiled":  # the reference, whatever its layers
        fp = fp or _untiled_footprint(model)
        home, x = x.device, x.to(module_device(model))  # the image where the network is
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        if tta is not None:
            return predict_full_tta(model, x, tta, fp).to(home, out_dtype)
        with torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None):
            return predict_full(model, x, fp).to(home, out_dtype)
    refuse_inexact_layers(model)
    check_footprint(model, fp, "infer")
    if chosen == "tiled":
        if not has_statistics(model) and uses_image_pool(model):
            raise ConfigError(f"infer: {type(model).__name__} pools over its whole input, so "
                              "plain tiles would each pool their own window; use "
                              "method='two_pass' (or 'auto')")
        return predict_tiled(model, x, q=q, tile_size=tile_size, fp=fp, autocast=autocast,
                             out_dtype=out_dtype, tta=tta, channels_last=channels_last)
    if chosen == "passes":
        return predict_tiled_exact(model, x, q=q, tile_size=tile_size, fp=fp,
                                   autocast=autocast, out_dtype=out_dtype,
                                   channels_last=channels_last)
    if not isinstance(model, ImagePooled) or not uses_image_pool(model):
        raise ConfigError("infer: method='two_pass' needs a network that pools its whole "
                          f"input by the two-pass protocol; {type(model).__name__} does not")
    return predict_tiled_two_pass(model, x, q=q, tile_size=tile_size,
                                  fp=fp or model_footprint(model), autocast=autocast,
                                  out_dtype=out_dtype)
