"""Model inputs read window by window from a raster file: the one reader of files.

Prediction (:mod:`seg_at_scale.prediction`) and training tiles (:mod:`seg_at_scale.data.tiles`)
both read through :class:`RasterWindows`, so both see outside the image exactly what the
untiled network sees (:func:`seg_at_scale.tiling.geometry.fill_of`): the reflection for
``valid`` models, and for ``same`` models zeros of the *normalised* input, set after
normalising (a raw zero normalises to ``-mean / std``, which no padding produces).

>>> from seg_at_scale.tiling import Footprint, Window
>>> src = RasterWindows(reader, Normalizer(1 / 255, (0.5,), (0.25,)), "constant")  # doctest: +SKIP
>>> x, invalid = src.read(Window(-16, -16, 96, 96))  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.io.raster import RasterReader
from seg_at_scale.io.valid import read_valid
from seg_at_scale.tiling.geometry import Fill, Window, inside

__all__ = ["RasterWindows", "zero_outside"]

A = TypeVar("A", np.ndarray, Tensor)


def zero_outside(x: A, keep: tuple[slice, slice]) -> A:
    """Zero ``x[..., h, w]`` (array or tensor) outside ``keep`` (in place; returns ``x``)."""
    rows, cols = keep
    h, w = x.shape[-2:]
    x[..., : rows.start, :] = 0
    x[..., rows.stop : h, :] = 0
    x[..., :, : cols.start] = 0
    x[..., :, cols.stop : w] = 0
    return x


@dataclass
class RasterWindows:
    """Normalised windows of a raster, extended past its border by the model's fill rule.

    Attributes:
        reader: the open raster.
        normalizer: raw samples to model input.
        fill: ``"reflect"`` or ``"constant"`` (``fill_of(footprint)``).
    """

    reader: RasterReader
    normalizer: Normalizer
    fill: Fill

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(bands, height, width)``."""
        return self.reader.shape

    def rescaled(self, window: Window) -> tuple[np.ndarray, tuple[slice, slice],
                                                np.ndarray | None]:
        """Rescaled (not yet standardised) window, the part inside the image, no-data mask."""
        raw, invalid = read_valid(self.reader, window, self.fill)
        return (self.normalizer.rescale(raw), inside(window, self.reader.height,
                                                     self.reader.width), invalid)

    def finish(self, x: np.ndarray, keep: tuple[slice, slice] | np.ndarray) -> np.ndarray:
        """Standardise a rescaled window and apply the fill rule outside ``keep``.

        ``keep`` is the inside as slices, or a boolean ``[h, w]`` mask (after a geometric
        augmentation moved it).
        """
        x = self.normalizer.standardize(x, in_place=True)  # x is ours (rescaled above)
        if self.fill == "reflect":
            return x  # the reflection of normalised pixels is the normalised reflection
        if isinstance(keep, np.ndarray):
            x[:, ~keep] = 0
            return x
        return zero_outside(x, keep)

    def read(self, window: Window) -> tuple[np.ndarray, np.ndarray | None]:
        """Model input ``[C, h, w]`` float32 for ``window`` and its no-data mask (or None)."""
        x, keep, invalid = self.rescaled(window)
        return self.finish(x, keep), invalid

    # -- the tile engine's two halves (seg_at_scale.tiling.engine) --------------------------

    def load(self, window: Window) -> tuple[np.ndarray, np.ndarray | None]:
        """Raw samples of ``window`` (fill rule applied, no-data zeroed), no-data mask.

        The engine's reader thread only reads; :meth:`prepare` does the arithmetic. A
        pixel-interleaved file's window keeps the file's ``[h, w, C]`` memory, which casts
        into a channels-last batch without reordering.
        """
        return read_valid(self.reader, window, self.fill, pixels=True)

    def prepare(self, raws: list[Tensor], keeps: list[tuple[slice, slice]],
                channels_last: bool) -> Tensor:
        """Model input ``[n, C, h, w]`` float32 from raw windows ``[1, C, h, w]``.

        The windows are tensors of one input size. They are cast, then
        :meth:`Normalizer.apply_` and the fill rule outside ``keeps`` act in place (the
        same bits as :meth:`read`, on torch's threads), then the batch takes the model's
        memory layout. ``keeps`` are the parts inside the image, in each window's frame.
        """
        n = sum(r.shape[0] for r in raws)
        layout = torch.channels_last if channels_last else torch.contiguous_format
        # one pass casts the samples into the model's layout; the arithmetic then runs in
        # place on it (the order of operations, so the bits, are those of read())
        x = torch.empty((n, *raws[0].shape[1:]), dtype=torch.float32, device=raws[0].device,
                        memory_format=layout)
        start = 0
        for r in raws:
            x[start : start + r.shape[0]].copy_(r)
            start += r.shape[0]
        self.normalizer.apply_(x)
        if self.fill == "constant":
            for k, keep in enumerate(keeps):
                zero_outside(x[k], keep)
        return x
