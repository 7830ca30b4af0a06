"""Tile-grid geometry: windows in, windows out.

Pure integer arithmetic, no tensors. Everything that makes halo tiling *exact* lives
here, so it is kept small and obvious (see ``docs/design.md``):

* every tile's input window starts at a multiple of the model's downsampling factor
  ``align`` (2^(L-1) for a U-Net with L levels), so its pooling grid is in phase with
  the whole image's;
* every input window is a size the model accepts;
* every tile's *core* (the output pixels it contributes) is at least ``halo`` pixels
  from any edge of its input window that is not also an edge of the extended image.

Coordinates are (row, col) in the **output / image frame**. For ``valid`` padding the
image is first extended by the halo on every side (reflect), so an input window in the
extended frame starts ``halo`` pixels before the core it produces; ``Tile.read`` is given
in image coordinates and may therefore start at negative values.

>>> fp = Footprint(halo=92, align=16, padding="valid", out_residue=4)
>>> grid = make_grid(611, 733, fp, q=2)
>>> grid.shape, grid.tiles[0].core
((2, 2), Window(row=0, col=0, height=304, width=368))
>>> round(grid.efficiency, 3)
2.443
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from seg_at_scale.errors import ConfigError

__all__ = [
    "Footprint",
    "Window",
    "Tile",
    "TileGrid",
    "TilingError",
    "make_grid",
    "tiles_per_side",
    "split_axis",
    "random_core",
    "cover",
    "Fill",
    "fill_of",
    "source_indices",
    "inside",
]

Padding = Literal["valid", "same"]
Fill = Literal["reflect", "constant"]


class TilingError(ConfigError):
    """The requested tiling cannot cover the image with this halo and alignment."""


@dataclass(frozen=True)
class Window:
    """A half-open rectangle ``[row, row + height) x [col, col + width)``."""

    row: int
    col: int
    height: int
    width: int

    @property
    def row_end(self) -> int:
        return self.row + self.height

    @property
    def col_end(self) -> int:
        return self.col + self.width

    @property
    def area(self) -> int:
        return self.height * self.width

    def slices(self) -> tuple[slice, slice]:
        """``(rows, cols)`` slices for indexing ``array[..., rows, cols]``."""
        return slice(self.row, self.row_end), slice(self.col, self.col_end)

    def shift(self, drow: int, dcol: int) -> Window:
        return Window(self.row + drow, self.col + dcol, self.height, self.width)


@dataclass(frozen=True)
class Footprint:
    """How a model maps input pixels to output pixels: all tiling needs to know.

    Attributes:
        halo: context in pixels needed on each side of an output pixel. For ``valid``
            padding this is also how much the output shrinks per side.
        align: the network's total downsampling factor; window origins are multiples.
        padding: ``"valid"`` (output = input - 2*halo) or ``"same"`` (output = input).
        out_residue: ``valid`` only: output sizes the model produces are
            ``out_residue (mod align)``; for ``same`` every multiple of ``align`` works.
    """

    halo: int
    align: int
    padding: Padding = "same"
    out_residue: int = 0

    def __post_init__(self) -> None:
        if self.halo < 0 or self.align < 1:
            raise ValueError(f"Footprint needs halo >= 0 and align >= 1, got {self}")
        if self.padding not in ("valid", "same"):
            raise ValueError(f"padding must be 'valid' or 'same', got {self.padding!r}")

    @property
    def context(self) -> int:
        """Pixels of context actually read on each inner side of a tile.

        ``same``: the halo rounded up to the alignment, so windows stay aligned.
        ``valid``: the halo itself (the window start is aligned, its size is not).
        """
        if self.padding == "same":
            return math.ceil(self.halo / self.align) * self.align
        return self.halo

    def output_length(self, length: int) -> int:
        """Smallest output length the model can produce that covers ``length`` pixels."""
        if self.padding == "same":
            return math.ceil(length / self.align) * self.align
        r = self.out_residue % self.align
        n = length + ((r - length) % self.align)
        return n if n > 0 else n + self.align


@dataclass(frozen=True)
class Tile:
    """One tile of a grid.

    Attributes:
        index: ``(i, j)`` position in the grid.
        core: output pixels this tile contributes, in image coordinates (inside the image).
        read: input window in image coordinates (may extend past the image: those pixels
            come from the extension, reflect for ``valid``, zeros for ``same``).
        crop: where ``core`` sits inside the tile's output, in tile-output coordinates.
    """

    index: tuple[int, int]
    core: Window
    read: Window
    crop: Window


@dataclass(frozen=True)
class TileGrid:
    """A grid of tiles covering an ``height x width`` image exactly once.

    Attributes:
        height: image height.
        width: image width.
        footprint: the model footprint the grid was made for.
        tiles: tiles in row-major order.
        shape: ``(rows, cols)`` of the grid.
        extended: the window of the extended image (image coordinates) that the
            untiled reference computation reads: ``model(extend(image))`` cropped to
            the image equals the stitched tiles.
    """

    height: int
    width: int
    footprint: Footprint
    tiles: tuple[Tile, ...]
    shape: tuple[int, int]
    extended: Window

    def __iter__(self) -> Iterator[Tile]:
        return iter(self.tiles)

    def __len__(self) -> int:
        return len(self.tiles)

    @property
    def efficiency(self) -> float:
        """E = input pixels computed / useful output pixels (1.0 = no halo overhead)."""
        return sum(t.read.area for t in self.tiles) / (self.height * self.width)

    def row_bands(self) -> Iterator[tuple[Tile, ...]]:
        """Tiles grouped by grid row, top to bottom (the order a streaming writer needs)."""
        cols = self.shape[1]
        for i in range(self.shape[0]):
            yield self.tiles[i * cols : (i + 1) * cols]


def split_axis(length: int, fp: Footprint, *, parts: int | None = None,
               tile: int | None = None, name: str = "axis", uniform: bool = False,
               ) -> list[tuple[int, int, int, int]]:
    """Split one axis into aligned tiles.

    Args:
        length: image length along this axis.
        fp: model footprint.
        parts: number of tiles (the seed's ``q``), or
        tile: maximal input window length (tile size including halo).
        name: axis name for error messages.
        uniform: every core but the last has the same length (a multiple of ``align``), so
            cores line up with the chunks of a regular chunk grid (the prediction store);
            the number of tiles may then be smaller than ``parts``.

    Returns:
        ``(core_lo, core_hi, read_lo, read_hi)`` per tile, image coordinates; cores
        partition ``[0, length)``.

    >>> split_axis(100, Footprint(halo=5, align=4), parts=3)
    [(0, 32, 0, 40), (32, 64, 24, 72), (64, 100, 56, 100)]
    """
    if length < 1:
        raise TilingError(f"{name} length must be positive, got {length}")
    for key, value in (("q", parts), ("tile_size", tile)):
        if value is not None and (isinstance(value, bool)
                                  or not isinstance(value, numbers.Integral)):
            raise TilingError(f"{key}={value!r}: give a whole number of "
                              + ("tiles per side" if key == "q" else "pixels")
                              + " (or a (rows, cols) pair of them)")
    if parts is not None and parts < 1:
        raise TilingError(f"q={parts}: give at least 1 tile per side (q=1 is one tile)")
    a, ctx = fp.align, fp.context
    out_len = fp.output_length(length)
    blocks = out_len // a  # whole aligned blocks; a valid tail (< align) joins the last tile
    if (parts is None) == (tile is None):
        raise TilingError("give exactly one of q (tiles per side) or tile_size")
    if parts is None:
        assert tile is not None
        max_core = (tile - 2 * ctx) // a * a
        if fp.padding == "valid":  # keep room for rounding the core up to the residue
            max_core = (tile - 2 * ctx - (fp.out_residue % a)) // a * a
        edge_only = _edge_parts(length, fp, tile, uniform)
        if edge_only is not None:
            parts = edge_only
        elif max_core < a:
            need = 2 * ctx + a + (fp.out_residue % a if fp.padding == "valid" else 0)
            raise TilingError(
                f"tile_size={tile} leaves no core along {name}: the halo takes {2 * ctx} "
                f"pixels and cores are multiples of {a}; use tile_size >= {need}")
        else:
            parts = max(1, math.ceil(blocks / (max_core // a)))
    if parts < 1 or parts > max(blocks, 1):
        raise TilingError(
            f"q={parts} cannot tile {name} of {length} pixels: tile origins must be "
            f"multiples of {a}, which allows at most q={max(blocks, 1)}; use a smaller q")
    out = []
    for lo, hi in _cores(out_len, a, parts, uniform):
        read_lo, read_hi, _ = cover_axis(lo, hi, length, fp)
        out.append((lo, min(hi, length), read_lo, read_hi))
    return out


def _cores(out_len: int, a: int, parts: int, uniform: bool) -> list[tuple[int, int]]:
    """Output spans of ``parts`` aligned cores covering ``[0, out_len)`` (the cut rule)."""
    blocks = out_len // a
    if uniform:
        # aligned blocks per core; an output shorter than one block is one core
        step = max(1, -(-blocks // parts))
        cuts = [a * step * k for k in range(max(1, -(-blocks // step)))] + [out_len]
    else:
        cuts = [a * (k * blocks // parts) for k in range(parts)] + [out_len]
    return list(zip(cuts[:-1], cuts[1:]))


def _edge_parts(length: int, fp: Footprint, tile: int, uniform: bool) -> int | None:
    """One or two tiles, when tiles that touch the image's edges cover it (same padding).

    An inner tile reads the context on both sides; a tile at an edge of a same-padding
    image reads none past the edge, so one tile covers an image up to ``tile`` long, and
    two tiles up to ``2 (tile - context)``: with two tiles per side a
    4096^2 image at ``tile_size=3072`` and a context of 848 takes 4 tiles (E 2.0) instead of
    9 (E 3.3); a scene shorter than ``tile`` is one tile even when ``tile`` is below the
    ``2 context + align`` an inner tile needs. ``None``: more tiles are needed, and then
    inner ones set the count.
    """
    if fp.padding != "same":
        return None
    out_len, a = fp.output_length(length), fp.align
    for parts in range(1, min(2, out_len // a) + 1):
        spans = [cover_axis(lo, hi, length, fp)[:2] for lo, hi in _cores(out_len, a, parts,
                                                                           uniform)]
        if all(r1 - r0 <= tile for r0, r1 in spans):
            return parts
    return None


def cover_axis(lo: int, hi: int, length: int, fp: Footprint) -> tuple[int, int, int]:
    """The exact input span for output pixels ``[lo, hi)`` of an axis of ``length`` pixels.

    The span starts on the pooling grid and reaches ``context`` pixels past the wanted
    outputs on every side that is not the extended image's edge, so the model computes
    those outputs exactly as on the whole image (docs/design.md, "Receptive fields and the halo").

    Returns:
        ``(read_lo, read_hi, offset)``: the input span in image coordinates and where
        ``lo`` sits in the model's output for that span.

    >>> cover_axis(37, 50, 100, Footprint(halo=5, align=4))
    (28, 60, 9)
    >>> cover_axis(37, 50, 100, Footprint(halo=5, align=4, padding="valid", out_residue=1))
    (31, 58, 1)
    """
    a, ctx = fp.align, fp.context
    start = lo // a * a
    if fp.padding == "same":
        read_lo = max(start - ctx, 0)
        read_hi = min(-(-hi // a) * a + ctx, fp.output_length(length))
        return read_lo, read_hi, lo - read_lo
    size = fp.output_length(hi - start)  # round the computed output up to a valid size
    return start - ctx, start + size + ctx, lo - start


def cover(region: Window, height: int, width: int, fp: Footprint) -> Tile:
    """A tile whose core is ``region`` (any window inside an ``height x width`` image).

    Grid tiles are covers of their cores; so are the transformed tiles of exact
    test-time augmentation, whose cores are not on the grid of the transformed image.

    >>> cover(Window(37, 5, 13, 20), 100, 80, Footprint(halo=5, align=4)).read
    Window(row=28, col=0, height=32, width=36)
    """
    r0, r1, dr = cover_axis(region.row, region.row_end, height, fp)
    c0, c1, dc = cover_axis(region.col, region.col_end, width, fp)
    return Tile((0, 0), region, Window(r0, c0, r1 - r0, c1 - c0),
                Window(dr, dc, region.height, region.width))


def fill_of(fp: Footprint) -> Fill:
    """What a model sees outside the image: the rule every tile reader follows.

    ``valid`` models read the image's reflection (as the untiled reference extends the
    image); ``same`` models read zeros *of the normalised input*, which is what their own
    zero padding gives the untiled network. Readers of raw files must therefore set those
    pixels to zero after normalising, never before.
    """
    return "reflect" if fp.padding == "valid" else "constant"


def source_indices(start: int, length: int, size: int, fill: Fill | Footprint) -> np.ndarray:
    """Source index of each position of ``[start, start + length)`` on an axis of ``size``.

    ``reflect`` follows ``numpy.pad(mode="reflect")`` (the edge is not repeated, and the
    pattern repeats with period ``2 * (size - 1)`` for windows reaching further out);
    ``constant`` marks positions outside the axis with ``-1`` (they read zeros).

    >>> source_indices(-2, 6, 3, "reflect").tolist()
    [2, 1, 0, 1, 2, 1]
    >>> source_indices(-2, 7, 4, "constant").tolist()
    [-1, -1, 0, 1, 2, 3, -1]
    """
    if isinstance(fill, Footprint):
        fill = fill_of(fill)
    idx = np.arange(start, start + length)
    if fill == "constant":
        return np.where((idx >= 0) & (idx < size), idx, -1)
    if size == 1:
        return np.zeros_like(idx)
    period = 2 * (size - 1)
    idx = np.mod(idx, period)
    return np.where(idx < size, idx, period - idx)


def inside(window: Window, height: int, width: int) -> tuple[slice, slice]:
    """The part of ``window`` inside the image, as slices of the window's own pixels.

    >>> inside(Window(-3, 5, 10, 10), 4, 12)
    (slice(3, 7, None), slice(0, 7, None))
    """
    r0, c0 = max(0, -window.row), max(0, -window.col)
    r1 = max(r0, min(window.height, height - window.row))
    c1 = max(c0, min(window.width, width - window.col))
    return slice(r0, r1), slice(c0, c1)


def make_grid(height: int, width: int, fp: Footprint, *, q: int | Sequence[int] | None = None,
              tile_size: int | Sequence[int] | None = None, uniform: bool = False
              ) -> TileGrid:
    """Cover an image with aligned halo tiles.

    Args:
        height: image height in pixels.
        width: image width in pixels.
        fp: the model's footprint (see :func:`seg_at_scale.tiling.footprint`).
        q: tiles per side (int, or ``(rows, cols)``: any pair, a config's list too), as in
            the seed's q x q grid. When
            both ``q`` and ``tile_size`` are given, ``q`` wins (the one place this rule
            is decided: every caller passes both as configured).
        tile_size: maximal input window (core + halo), int or ``(h, w)``.
        uniform: equal cores (but the last) along each axis; see :func:`split_axis`.

    Returns:
        The grid; ``grid.efficiency`` is the seed's E.

    Raises:
        TilingError: naming q / tile_size, the value and a value that works.
    """
    if q is not None:
        tile_size = None
    qr, qc = _pair("q", q)
    tr, tc = _pair("tile_size", tile_size)
    rows = split_axis(height, fp, parts=qr, tile=tr, name=f"height ({height})",
                      uniform=uniform)
    cols = split_axis(width, fp, parts=qc, tile=tc, name=f"width ({width})", uniform=uniform)
    tiles = []
    for i, (r0, r1, _, _) in enumerate(rows):
        for j, (c0, c1, _, _) in enumerate(cols):
            t = cover(Window(r0, c0, r1 - r0, c1 - c0), height, width, fp)
            tiles.append(Tile((i, j), t.core, t.read, t.crop))
    ext = _extended(height, width, fp)
    return TileGrid(height, width, fp, tuple(tiles), (len(rows), len(cols)), ext)


def tiles_per_side(key: str, value: Any, fix: str) -> int | tuple[int, int] | None:
    """``value`` as tiles per side: None, a whole number >= 1, or a ``(rows, cols)`` pair.

    The one rule for ``q`` wherever a user gives it (``seg-predict q=``, ``tiling.q``);
    ``key`` and ``fix`` are the caller's words for the refusal.

    >>> tiles_per_side("q", [1, 4], "give ..."), tiles_per_side("q", 2, "give ...")
    ((1, 4), 2)
    >>> tiles_per_side("tiling.q", [0, 2], "give whole numbers >= 1")
    Traceback (most recent call last):
    ...
    seg_at_scale.errors.ConfigError: tiling.q=[0, 2]: give whole numbers >= 1

    Raises:
        ConfigError: naming ``key``, the value as given and the fix.
    """
    if value is None:
        return None
    pair = isinstance(value, Iterable) and not isinstance(value, str | bytes)
    items = tuple(value) if pair else (value,)
    shown = list(items) if pair else value
    if pair and len(items) != 2:
        raise ConfigError(f"{key}={shown!r}: give one number of tiles per side for both axes, "
                          "or [rows, cols]")
    for item in items:
        if isinstance(item, bool) or not isinstance(item, numbers.Integral) or item < 1:
            raise ConfigError(f"{key}={shown!r}: {fix}")
    return (int(items[0]), int(items[1])) if pair else int(items[0])


def _pair(key: str, value: Any) -> tuple[Any, Any]:
    """``(rows, cols)`` of ``value``: one value for both axes, or a pair (tuple, list)."""
    if value is None or isinstance(value, numbers.Number | str):
        return value, value  # checked by split_axis, naming the key
    items = tuple(value) if isinstance(value, Iterable) else (value,)
    if len(items) != 2:
        raise TilingError(f"{key}={list(items)!r}: give one value for both axes or a "
                          "[rows, cols] pair")
    return items[0], items[1]


def _extended(height: int, width: int, fp: Footprint) -> Window:
    """The extended-image window of the untiled reference computation."""
    oh, ow = fp.output_length(height), fp.output_length(width)
    if fp.padding == "same":
        return Window(0, 0, oh, ow)
    h = fp.halo
    return Window(-h, -h, oh + 2 * h, ow + 2 * h)


def random_core(height: int, width: int, fp: Footprint, core: int,
                rng_values: tuple[float, float]) -> Tile:
    """An aligned training tile with a ``core x core`` output at a random position.

    Args:
        height: image height.
        width: image width.
        fp: model footprint.
        core: wanted core side (rounded down to a size the model produces, at least one
            aligned block).
        rng_values: two uniform numbers in ``[0, 1)`` choosing the row and column.

    Returns:
        A tile whose core lies inside the image, origin aligned to ``fp.align``.
    """
    a = fp.align
    side = max(a, core // a * a)
    if fp.padding == "valid":
        side = fp.output_length(side)
        while side > max(a, core) and side - a > 0:
            side -= a
    spans = []
    for length, u in zip((height, width), rng_values):
        s = min(side, fp.output_length(length))
        last = max(0, (length - s) // a)  # aligned origins whose core stays inside
        lo = a * min(int(u * (last + 1)), last)
        spans.append((lo, s))
    (r0, h), (c0, w) = spans
    ctx = fp.context
    if fp.padding == "same":
        oh, ow = fp.output_length(height), fp.output_length(width)
        rr0, cc0 = max(r0 - ctx, 0), max(c0 - ctx, 0)
        read = Window(rr0, cc0, min(r0 + h + ctx, oh) - rr0, min(c0 + w + ctx, ow) - cc0)
        crop = Window(r0 - rr0, c0 - cc0, min(h, height - r0), min(w, width - c0))
    else:
        read = Window(r0 - ctx, c0 - ctx, h + 2 * ctx, w + 2 * ctx)
        crop = Window(0, 0, min(h, height - r0), min(w, width - c0))
    core_w = Window(r0, c0, crop.height, crop.width)
    return Tile((0, 0), core_w, read, crop)
