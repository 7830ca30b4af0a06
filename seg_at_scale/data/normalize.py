"""Raw raster samples to model inputs: ``(x * scale - mean) / std`` per band.

>>> import numpy as np
>>> Normalizer(scale=1 / 255, mean=(0.5,), std=(0.25,))(np.full((2, 1, 1), 255, np.uint8))[:, 0, 0]
array([2., 2.], dtype=float32)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from seg_at_scale.errors import InputError

__all__ = ["Normalizer"]


@dataclass(frozen=True)
class Normalizer:
    """``(x * scale - mean) / std`` per band, applied to raw samples ``[C, h, w]``."""

    scale: float = 1.0 / 255.0
    mean: Sequence[float] = (0.0,)
    std: Sequence[float] = (1.0,)

    def __post_init__(self) -> None:
        """Refuse values that give no input: a std that is not > 0, a NaN or infinite value.

        A zero std divided every sample of its band to infinity, and the network predicted
        one class everywhere with a numpy warning at most.
        """
        for key, values in (("scale", [self.scale]), ("mean", self.mean), ("std", self.std)):
            for band, v in enumerate(values):
                where = "" if key == "scale" else f" for band {band}"
                if key == "std" and not v > 0:
                    raise InputError(f"normalization std has {v}{where}: a standard deviation "
                                     "divides the band, so it must be > 0; give the band's "
                                     "spread (e.g. 0.25)")
                if not np.isfinite(v) or (key == "scale" and v == 0):
                    raise InputError(f"normalization {key} has {v}{where}: give a finite, "
                                     "non-zero value" if key == "scale" else
                                     f"normalization {key} has {v}{where}: give a finite value")

    def check_bands(self, bands: int) -> None:
        """Refuse means or stds that are neither one value nor one per band of ``bands``."""
        if len(self.mean) not in (1, bands) or len(self.std) not in (1, bands):
            raise InputError(f"normalization has {len(self.mean)} means / {len(self.std)} "
                             f"stds for {bands} bands; give one value per band (data.mean / "
                             "data.std)")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.standardize(self.rescale(x), in_place=True)

    def rescale(self, x: np.ndarray) -> np.ndarray:
        """Raw samples to float32 in about ``[0, 1]`` (where photometric augmentation acts).

        The result is band after band in memory (``[C, h, w]`` C-contiguous) whatever the
        layout of ``x``: numpy's per-band arithmetic after it runs along rows, 8x faster
        than along a pixel's few bands.
        """
        out = x.astype(np.float32, order="C")
        out *= np.float32(self.scale)
        return out

    def standardize(self, x: np.ndarray, in_place: bool = False) -> np.ndarray:
        """``(x - mean) / std`` per band of a rescaled ``[C, h, w]`` array.

        ``in_place`` reuses ``x`` (one array instead of three: the same arithmetic, so the
        same bits).
        """
        self.check_bands(x.shape[0])
        mean = np.asarray(self.mean, np.float32).reshape(-1, 1, 1)
        std = np.asarray(self.std, np.float32).reshape(-1, 1, 1)
        if not in_place:
            return (x - mean) / std
        x -= mean
        x /= std
        return x

    def apply_(self, x: Tensor) -> Tensor:
        """Normalise raw samples already cast to ``x`` (float32 ``[..., C, h, w]``) in place.

        The same float32 operations, in the same order, as :meth:`__call__`: the same bits,
        computed by torch's threads (on the model's thread or its GPU) instead of numpy's
        one.
        """
        c = x.shape[-3]
        self.check_bands(c)
        scale, mean, std = _constants(float(self.scale), tuple(map(float, self.mean)),
                                      tuple(map(float, self.std)), x.dtype, x.device)
        x.mul_(scale)
        if c > 1 and x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
            # channels-last puts the bands innermost: broadcast [C, 1, 1] along them is
            # torch's slow path, rows of width * C samples against the values repeated
            # along a row its fast one (the same operations on each sample: the same bits)
            n, _, h, w = x.shape
            mean, std = _along_rows(mean, std, c, w)
            x.permute(0, 2, 3, 1).view(n * h, w * c).sub_(mean).div_(std)
            return x
        return x.sub_(mean).div_(std)


@functools.lru_cache(maxsize=64)
def _along_rows(mean: Tensor, std: Tensor, bands: int, width: int) -> tuple[Tensor, Tensor]:
    """Means and stds (``[C or 1, 1, 1]``) repeated along a channels-last row.

    A row holds ``width`` pixels of ``bands`` bands each.
    """
    with torch.inference_mode(False):
        return (mean.reshape(-1).expand(bands).repeat(width),
                std.reshape(-1).expand(bands).repeat(width))


@functools.lru_cache(maxsize=64)
def _constants(scale: float, mean: tuple[float, ...], std: tuple[float, ...],
               dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The scale, means and stds as tensors on ``device``, made once per device.

    A copy from pageable host memory waits for the device to finish its queued work: made
    so per batch, they kept a GPU from having the next batch queued behind the current.
    Here they cross from pinned memory, once, without waiting.
    """

    def on_device(values: Any) -> Tensor:
        t = torch.tensor(values, dtype=dtype)
        if device.type == "cuda":
            return t.pin_memory().to(device, non_blocking=True)
        return t.to(device)

    with torch.inference_mode(False):  # plain tensors, usable in and out of inference
        return (on_device(np.float32(scale)), on_device(mean).reshape(-1, 1, 1),
                on_device(std).reshape(-1, 1, 1))
