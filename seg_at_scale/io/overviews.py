"""Mode overviews of class-label rasters, computed while the labels stream past.

GDAL's ``MODE`` resampling is exact but slow (about two thirds of a COG's finalisation on
this project's machine). Labels have few classes, so the mode of each 2 x 2 block is one
look-up in a table of every block's mode (up to 15 classes; beyond, a few vectorised
comparisons per class): :class:`ModePyramid` halves each level row band by row band as it
is written, spilling every level to a raw temporary file, so memory stays at
one band whatever the raster's size. No-data (255) is ignored unless a block is all no-data;
ties go to the lowest class id.

>>> x = np.array([[1, 1, 2, 255], [0, 3, 2, 255], [4, 4, 4, 4]], np.uint8)
>>> mode2x2(np.vstack([x, np.full((1, 4), 255, np.uint8)]), 5).tolist()
[[1, 2], [4, 4]]
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import suppress
from functools import lru_cache
from pathlib import Path

import numpy as np

from seg_at_scale.io.threads import by_rows

__all__ = ["mode2x2", "mode2x2_counted", "ModePyramid", "overview_shapes"]

NODATA = 255


def overview_shapes(height: int, width: int, block: int) -> list[tuple[int, int]]:
    """Halved sizes (rounded up) until the level fits in one ``block``, as GDAL makes them.

    >>> overview_shapes(1300, 700, 512)
    [(650, 350), (325, 175)]
    """
    shapes: list[tuple[int, int]] = []
    h, w = height, width
    while max(h, w) > block:
        h, w = -(-h // 2), -(-w // 2)
        shapes.append((h, w))
    return shapes


def mode2x2(band: np.ndarray, num_classes: int) -> np.ndarray:
    """Mode of each 2 x 2 block of ``band [2h, W]`` (``W`` padded to even with no-data).

    Up to 15 classes (what land-cover and most label sets have) a block's four labels,
    each clamped to a nibble, index a table of every block's mode (:func:`_mode_table`,
    made by :func:`mode2x2_counted` itself, so both give the same labels); more classes
    count each class.
    """
    if band.shape[1] % 2:
        band = np.pad(band, ((0, 0), (0, 1)), constant_values=NODATA)
    out = np.empty((band.shape[0] // 2, band.shape[1] // 2), np.uint8)

    def piece(r0: int, r1: int) -> None:  # rows of 2 x 2 blocks on the pixel threads
        out[r0 // 2 : r1 // 2] = _mode_of(band[r0:r1], num_classes)

    by_rows(piece, band.shape[0], band.shape[1], multiple=2)
    return out


def _mode_of(band: np.ndarray, num_classes: int) -> np.ndarray:
    """:func:`mode2x2` of ``band [2h, W]`` (``W`` even), in this thread."""
    if num_classes > _NIBBLE:
        return mode2x2_counted(band, num_classes)
    # each label clamped to 15 (every value >= num_classes is ignored, as 255 is); two
    # horizontal neighbours read as one uint16 fold into one byte (left | right << 4 on a
    # little-endian machine); the top and bottom rows' bytes make the table's index. A
    # block's mode does not depend on where its labels sit, so the byte order does not
    # matter either.
    pairs = np.minimum(band, _NIBBLE).view(np.uint16)
    nibbles = (pairs | (pairs >> 4)).astype(np.uint8)
    index = nibbles[0::2].astype(np.uint16)
    index |= nibbles[1::2].astype(np.uint16) << 8
    return _mode_table(num_classes)[index]


def mode2x2_counted(band: np.ndarray, num_classes: int) -> np.ndarray:
    """:func:`mode2x2` by counting each class (``band [2h, W]``, ``W`` even)."""
    # contiguous copies: comparisons on stride-2 views run ~10x slower
    quads = [np.ascontiguousarray(band[r::2, c::2]) for r in (0, 1) for c in (0, 1)]
    best = np.full(quads[0].shape, NODATA, np.uint8)
    best_count = np.zeros(quads[0].shape, np.uint8)
    count = np.empty_like(best_count)
    hit = np.empty(best.shape, bool)
    for k in range(num_classes):
        np.equal(quads[0], k, out=hit)
        count[...] = hit
        for q in quads[1:]:
            np.equal(q, k, out=hit)
            count += hit
        np.greater(count, best_count, out=hit)
        np.copyto(best, np.uint8(k), where=hit)
        np.maximum(best_count, count, out=best_count)
    return best


_NIBBLE = 15


@lru_cache(maxsize=_NIBBLE + 1)
def _mode_table(num_classes: int) -> np.ndarray:
    """The mode of every 2 x 2 block of nibbles.

    At index ``tl | tr << 4 | bl << 8 | br << 12``; a nibble ``>= num_classes`` is ignored,
    as no-data is.
    """
    index = np.arange(1 << 16, dtype=np.uint32)
    tl, tr, bl, br = ((index >> s) & 0xF for s in (0, 4, 8, 12))
    top = np.stack([tl, tr], axis=1).reshape(1, -1)
    bottom = np.stack([bl, br], axis=1).reshape(1, -1)
    band = np.vstack([top, bottom]).astype(np.uint8)
    band[band >= num_classes] = NODATA
    table = mode2x2_counted(band, num_classes)[0]
    table.flags.writeable = False
    return table


class _Halver:
    """Consumes a level's row bands, appends the next level's rows to a raw file."""

    def __init__(self, path: Path, num_classes: int) -> None:
        self.path, self.k = path, num_classes
        self.file = open(path, "wb")  # noqa: SIM115 - closed in finish()
        self.carry: np.ndarray | None = None

    def feed(self, band: np.ndarray) -> None:
        if self.carry is not None:
            band = np.vstack([self.carry, band])
            self.carry = None
        if band.shape[0] % 2:
            band, self.carry = band[:-1], band[-1:]
        if band.shape[0]:
            self.file.write(np.ascontiguousarray(mode2x2(band, self.k)).tobytes())

    def finish(self) -> None:
        if self.carry is not None:
            self.feed(np.full_like(self.carry, NODATA))
        self.file.close()


class ModePyramid:
    """Mode overview levels of a single-band uint8 label raster, level by level.

    Wrap the main level's bands with :meth:`tee` while they are written; afterwards each
    :meth:`level` yields level ``k``'s bands (from its raw file) and computes level
    ``k + 1`` on the way. Call :meth:`close` to delete the temporary files.
    """

    def __init__(self, height: int, width: int, num_classes: int, block: int,
                 folder: Path, stem: str) -> None:
        self.shapes = overview_shapes(height, width, block)
        self.k, self.rows = num_classes, block
        self.files = [folder / f".{stem}.ov{i + 1}.{os.getpid()}.tmp"
                      for i in range(len(self.shapes))]

    def tee(self, bands: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        """Pass the main level's bands through, computing level 1."""
        return self._through(bands, 0)

    def level(self, i: int) -> Iterator[np.ndarray]:
        """Level ``i + 1``'s bands (``i`` counts from 0), computing the next level."""
        h, w = self.shapes[i]
        def read() -> Iterator[np.ndarray]:
            with open(self.files[i], "rb") as f:
                for r in range(0, h, self.rows):
                    n = min(self.rows, h - r)
                    yield np.frombuffer(f.read(n * w), np.uint8).reshape(n, w)
        return self._through(read(), i + 1)

    def _through(self, bands: Iterable[np.ndarray], nxt: int) -> Iterator[np.ndarray]:
        halver = _Halver(self.files[nxt], self.k) if nxt < len(self.files) else None
        for band in bands:
            if halver is not None:
                halver.feed(band[0] if band.ndim == 3 else band)
            yield band
        if halver is not None:
            halver.finish()

    def close(self) -> None:
        for f in self.files:
            with suppress(OSError):
                f.unlink()
