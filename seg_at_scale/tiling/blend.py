"""Overlap-and-blend inference: what peers do, approximate (a reference, not a code path).

The image is covered by overlapping windows and their logits are averaged with Gaussian
weights, as MONAI's ``sliding_window_inference`` (``mode="gaussian"``,
``sigma_scale=0.125``) does: a window's centre counts most, its borders least. The result
is *not* the whole-image forward; :func:`label_deviation` measures how far it is. The
tests use it to show what blending costs on the networks this package refuses to tile
exactly (squeeze-excitation, attention; :mod:`seg_at_scale.models.smp_tileable`). What
``tiling.exact=false`` runs is different: halo tiles sized by the approximate footprint,
each tile's core kept (:meth:`seg_at_scale.models.SMPModel.approximate_footprint`).

Windows are aligned to the network's downsampling factor and the image is extended with
zeros to a multiple of it, as the exact path does (the model input's zero is its own
padding's).

>>> import torch
>>> net = torch.nn.Conv2d(2, 3, 3, padding=1).eval()
>>> x = torch.randn(1, 2, 40, 56)
>>> y = predict_blended(net, x, window=32, overlap=0.5, align=8)
>>> tuple(y.shape), bool(torch.allclose(predict_blended(net, x, window=64, align=8), net(x),
...                                     atol=1e-6))
((1, 3, 40, 56), True)
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.tiling.halo import alignment

__all__ = ["gaussian_weights", "window_starts", "predict_blended", "label_deviation"]


def gaussian_weights(height: int, width: int, sigma_scale: float = 0.125) -> Tensor:
    """Importance map ``[height, width]``: a centred Gaussian (sigma = scale x side), max 1.

    Values are clamped below at the smallest non-zero value or 1e-3, as MONAI's
    ``compute_importance_map`` does, so no pixel has zero total weight.
    """
    def axis(n: int) -> Tensor:
        c = (n - 1) / 2
        sigma = max(sigma_scale * n, 1e-6)
        i = torch.arange(n, dtype=torch.float64)
        return torch.exp(-0.5 * ((i - c) / sigma) ** 2)

    w = axis(height)[:, None] * axis(width)[None, :]
    w = w / w.max()
    floor = max(float(w[w > 0].min()), 1e-3)
    return w.clamp_min(floor).float()


def window_starts(length: int, window: int, overlap: float, align: int) -> list[int]:
    """Aligned window starts covering ``[0, length)`` (length a multiple of ``align``).

    >>> window_starts(96, 32, 0.25, 8)
    [0, 24, 48, 64]
    """
    if window >= length:
        return [0]
    step = max(align, int(window * (1 - overlap)) // align * align)
    starts = list(range(0, length - window, step))
    return starts + [length - window]


def _checked(window: int, overlap: float, align: int) -> int:
    if not 0 <= overlap < 1:
        raise ConfigError(f"overlap={overlap}: use a fraction in [0, 1) (e.g. 0.25)")
    if window < align:
        raise ConfigError(f"window={window} is below the model's alignment {align}; use a "
                          f"multiple of {align}")
    return window // align * align


@torch.no_grad()
def predict_blended(model: nn.Module, image: Tensor, *, window: int, overlap: float = 0.25,
                    sigma_scale: float = 0.125, align: int | None = None,
                    autocast: torch.dtype | None = None, channels_last: bool = False,
                    out_dtype: torch.dtype = torch.float32) -> Tensor:
    """Gaussian-blended logits ``[B, K, H, W]`` from overlapping windows (approximate).

    Args:
        model: the network in eval mode.
        image: the normalised image ``[B, C, H, W]``.
        window: window side in pixels (rounded down to the alignment).
        overlap: fraction of a window shared with its neighbour (MONAI's ``overlap``).
        sigma_scale: the Gaussian's sigma as a fraction of the window.
        align: downsampling factor (default ``model.downsampling_factor`` or 1).
        autocast: e.g. ``torch.bfloat16``; None is fp32.
        channels_last: run the windows in NHWC layout.
        out_dtype: dtype of the result, on the image's device (the windows run on the
            model's).
    """
    a = int(align or alignment(model))
    win = _checked(window, overlap, a)
    h, w = image.shape[-2:]
    eh, ew = math.ceil(h / a) * a, math.ceil(w / a) * a
    x = F.pad(image, (0, ew - w, 0, eh - h))  # zeros: the model's own padding value
    wh, ww = min(win, eh), min(win, ew)
    weight = gaussian_weights(wh, ww, sigma_scale).to(image.device)
    device = next(model.parameters()).device
    acc: Tensor | None = None  # on the image's device, as predict_tiled's result
    total = torch.zeros(eh, ew, device=image.device)
    ctx = torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    for r in window_starts(eh, wh, overlap, a):
        for c in window_starts(ew, ww, overlap, a):
            tile = x[..., r : r + wh, c : c + ww].to(device)
            if channels_last:
                tile = tile.contiguous(memory_format=torch.channels_last)
            with ctx:
                y = model(tile).float().to(image.device)
            if acc is None:
                acc = torch.zeros(image.shape[0], y.shape[1], eh, ew, device=image.device)
            acc[..., r : r + wh, c : c + ww] += y * weight
            total[r : r + wh, c : c + ww] += weight
    assert acc is not None
    return (acc / total)[..., :h, :w].to(out_dtype)


def label_deviation(approx: Tensor, reference: Tensor) -> dict[str, float]:
    """How far blended logits are from the whole-image ones: % labels, max |logit| gap."""
    labels = (approx.argmax(1) != reference.argmax(1)).float().mean()
    return {"labels_off_pct": round(100 * float(labels), 4),
            "max_logit_gap": float((approx - reference).abs().max())}

