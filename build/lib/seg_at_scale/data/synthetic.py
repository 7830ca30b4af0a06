"""The embedded synthetic dataset: satellite-like scenes whose classes need context.

Run it (``seg-synth --help``)::

    seg-synth --out data/synthetic --height 1024 --width 1024 --seed 0
    seg-synth --single image.tif mask.tif --height 50000 --width 50000

Scenes have four bands (R, G, B, NIR) and five classes (:data:`CLASSES`). Bare ground,
vegetation and water differ per pixel (vegetation: high NIR; water: dark, very low NIR).
Roads and buildings share *one* spectral signature (grey concrete, same noise): only shape
and context tell them apart (long thin street segments vs compact rectangles casting a
shadow), which is what a U-Net's receptive field is for. Shadows are labelled background.
City blocks are ~96 px, lakes and parks ~50-300 px. Class balance, mean of 40 scenes of
1024^2 (one scene varies by a few points): background 43 %, vegetation 24 %, water 13 %,
road 9 %, building 11 %.

Every pixel is a pure function of ``(seed, row, col)``: per-pixel noise is an integer hash
of the coordinates, land cover is value noise whose lattice values are hashes of lattice
coordinates, and streets and buildings are drawn per city block from hashes of the block
index. Hence ``render(big)`` cropped equals ``render(crop)`` bit for bit, which makes
streaming a 50,000 x 50,000 scene in bands of rows (or rendering in parallel) trivial.

>>> gen = SceneGenerator(seed=0, height=203, width=317)
>>> image, mask = gen.render(Window(0, 0, 203, 317))
>>> image.shape, image.dtype, mask.shape, mask.dtype
((4, 203, 317), dtype('uint8'), (203, 317), dtype('uint8'))
>>> bool((gen.render(Window(50, 60, 20, 30))[0] == image[:, 50:70, 60:90]).all())
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from seg_at_scale.errors import ConfigError
from seg_at_scale.tiling.geometry import Window

__all__ = [
    "CLASSES",
    "IGNORE_INDEX",
    "SceneGenerator",
]

CLASSES: tuple[str, ...] = ("background", "vegetation", "water", "road", "building")
IGNORE_INDEX = 255
#: Bump when the generator's output changes, so that stale datasets on disk are detected.
GENERATOR_VERSION = 1
BACKGROUND, VEGETATION, WATER, ROAD, BUILDING, SHADOW = range(6)  # SHADOW: a look, not a class

# Appearance per look (rows: bare, vegetation, water, road, building, shadow) in 8-bit
# levels at illumination 1; bands R, G, B, NIR, SWIR1, SWIR2. Road == building on purpose.
_COLOURS = np.array(
    [[150, 125, 95, 135, 175, 150],
     [55, 95, 50, 185, 95, 55],
     [30, 55, 75, 14, 8, 6],
     [128, 128, 132, 118, 140, 130],
     [128, 128, 132, 118, 140, 130],
     [38, 40, 52, 40, 35, 30]], dtype=np.float32)
_STEP = 8  # low-frequency fields are computed every _STEP px and bilinearly upsampled
_BLOCK = 1024  # big windows are rendered in blocks of this side (cache-friendly, ~2x faster)
_PITCH = 96  # city-block pitch (street-line spacing) in px
_MAX_BUILDINGS = 6  # per city block
# Field -> (hash tag, octaves as (lattice spacing px, amplitude)); values in [0, 1].
_FIELDS = {
    "water": (11, ((192, 1.0), (96, 0.5), (48, 0.25))),
    "vegetation": (12, ((160, 1.0), (72, 0.6), (32, 0.3))),
    "urban": (13, ((384, 1.0), (160, 0.5))),
    "light": (14, ((320, 1.0), (96, 0.5), (24, 0.35))),
}
_WATER_BELOW = 0.34  # thresholds calibrated for the class balance of the module docstring
_VEGETATION_ABOVE = 0.545
_DTYPE_SCALE = {np.dtype(np.uint8): 1.0, np.dtype(np.uint16): 257.0,
                np.dtype(np.float32): 1.0 / 255.0}  # 8-bit levels -> dtype
_ODD = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
        0xFF51AFD7ED558CCD, 0x85EBCA77C2B2AE63)


def _mix64(h: np.ndarray) -> np.ndarray:
    """Apply the splitmix64 finaliser to a uint64 array (wrapping arithmetic)."""
    h = h ^ (h >> np.uint64(30))
    h = h * np.uint64(0xBF58476D1CE4E5B9)
    h = h ^ (h >> np.uint64(27))
    h = h * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def _hash(key: int, *coords: Any) -> np.ndarray:
    """Hash a key and up to six integer coordinate arrays (broadcast) to uint64."""
    with np.errstate(over="ignore"):
        acc = np.full((), key & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64)
        for c, odd in zip(coords, _ODD[:len(coords)], strict=True):
            acc = acc + np.asarray(c, dtype=np.int64).astype(np.uint64) * np.uint64(odd)
        return _mix64(_mix64(np.asarray(acc)))


def _uniform(key: int, *coords: Any) -> np.ndarray:
    """Return uniform floats in ``[0, 1)`` (float64), one per broadcast coordinate."""
    return (_hash(key, *coords) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _mix32(h: np.ndarray) -> np.ndarray:
    """Apply murmur3's fmix32 in place to a uint32 array."""
    tmp = np.empty_like(h)
    for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        np.right_shift(h, shift, out=tmp)
        h ^= tmp
        h *= np.uint32(mul)
    np.right_shift(h, 16, out=tmp)
    h ^= tmp
    return h


def _smooth(t: np.ndarray) -> np.ndarray:
    return t * t * (3.0 - 2.0 * t)


def _noise_grid(key: int, field: str, ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """Evaluate value noise on the grid ``ys x xs`` (absolute px): ``[Y, X]`` float32."""
    tag, octaves = _FIELDS[field]
    total = np.zeros((ys.size, xs.size), np.float32)
    for o, (spacing, amp) in enumerate(octaves):
        ly, lx = ys // spacing, xs // spacing
        ty = _smooth((ys % spacing).astype(np.float32) / np.float32(spacing))
        tx = _smooth((xs % spacing).astype(np.float32) / np.float32(spacing))
        ry, rx = np.arange(ly[0], ly[-1] + 2), np.arange(lx[0], lx[-1] + 2)
        lattice = _uniform(key, tag, o, ry[:, None], rx[None, :]).astype(np.float32)
        a, b = lattice.take(lx - rx[0], axis=1), lattice.take(lx - rx[0] + 1, axis=1)
        row = a + (b - a) * tx  # [lattice rows, X]
        a, b = row[ly - ry[0]], row[ly - ry[0] + 1]
        total += np.float32(amp) * (a + (b - a) * ty[:, None])
    return total / np.float32(sum(amp for _, amp in octaves))


def _noise_points(key: int, field: str, ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """Evaluate the value noise of :func:`_noise_grid` at scattered points (float64)."""
    tag, octaves = _FIELDS[field]
    total = np.zeros(np.broadcast(ys, xs).shape)
    for o, (spacing, amp) in enumerate(octaves):
        ly, lx = ys // spacing, xs // spacing
        ty, tx = _smooth((ys % spacing) / spacing), _smooth((xs % spacing) / spacing)
        v = [_uniform(key, tag, o, ly + dy, lx + dx) for dy in (0, 1) for dx in (0, 1)]
        top, bottom = v[0] + (v[1] - v[0]) * tx, v[2] + (v[3] - v[2]) * tx
        total += amp * (top + (bottom - top) * ty)
    return total / sum(amp for _, amp in octaves)


def _field(key: int, name: str, window: Window) -> np.ndarray:
    """Compute a low-frequency field in ``[0, 1]`` at full resolution: ``[h, w]`` float32.

    The field is evaluated every ``_STEP`` px at absolute positions and bilinearly
    upsampled with element-wise float32 operations only, so each pixel's value does not
    depend on the window it is rendered in.
    """
    p0, q0 = window.row // _STEP, window.col // _STEP
    ys = np.arange(p0, (window.row_end - 1) // _STEP + 2) * _STEP
    xs = np.arange(q0, (window.col_end - 1) // _STEP + 2) * _STEP
    coarse = _noise_grid(key, name, ys, xs)
    cols = np.arange(window.col, window.col_end)
    qx, tx = cols // _STEP - q0, (cols % _STEP).astype(np.float32) / np.float32(_STEP)
    a = coarse.take(qx, axis=1)  # take, not [:, qx]: keeps rows contiguous (3x faster)
    row = coarse.take(qx + 1, axis=1)
    row -= a
    row *= tx
    row += a  # [coarse rows, w]
    rows = np.arange(window.row, window.row_end)
    py, ty = rows // _STEP - p0, (rows % _STEP).astype(np.float32) / np.float32(_STEP)
    out, a = row.take(py + 1, axis=0), row.take(py, axis=0)
    out -= a
    out *= ty[:, None]
    out += a
    return out


@dataclass(frozen=True)
class _Rects:
    """Axis-aligned rectangles ``[r0, r1) x [c0, c1)`` in absolute px, in paint order."""

    r0: np.ndarray
    r1: np.ndarray
    c0: np.ndarray
    c1: np.ndarray

    def __add__(self, other: _Rects) -> _Rects:
        pairs = zip(self.fields(), other.fields(), strict=True)
        return _Rects(*(np.concatenate([a, b]) for a, b in pairs))

    def fields(self) -> tuple[np.ndarray, ...]:
        """Return ``(r0, r1, c0, c1)``."""
        return self.r0, self.r1, self.c0, self.c1

    def select(self, keep: np.ndarray) -> _Rects:
        """Keep the rectangles where ``keep`` is true."""
        return _Rects(*(a[keep] for a in self.fields()))

    def paint(self, look: np.ndarray, window: Window, value: int, *, over_water: bool) -> None:
        """Paint the rectangles, clipped to ``window``, into ``look [h, w]``."""
        r0, r1 = (np.clip(a - window.row, 0, window.height) for a in (self.r0, self.r1))
        c0, c1 = (np.clip(a - window.col, 0, window.width) for a in (self.c0, self.c1))
        hit = (r1 > r0) & (c1 > c0)
        for a, b, c, d in zip(*(x[hit].tolist() for x in (r0, r1, c0, c1)), strict=True):
            if over_water:
                look[a:b, c:d] = value
            else:
                sub = look[a:b, c:d]
                sub[sub != WATER] = value


class SceneGenerator:
    """A deterministic, window-independent synthetic scene of ``height x width`` pixels.

    Args:
        seed: scene seed; equal seeds give identical scenes, any int is fine.
        height: scene height in px (used by writers; any window can be rendered).
        width: scene width in px.
        bands: number of image bands, 1 to 6 (R, G, B, NIR, SWIR1, SWIR2).
        dtype: image dtype: uint8 (0..255), uint16 (8-bit levels x 257) or float32 (0..1).
    """

    def __init__(self, seed: int, height: int, width: int, *, bands: int = 4,
                 dtype: Any = np.uint8) -> None:
        if not 1 <= bands <= _COLOURS.shape[1]:
            raise ConfigError(f"bands={bands} is not supported; use 1 to {_COLOURS.shape[1]}")
        self.dtype = np.dtype(dtype)
        if self.dtype not in _DTYPE_SCALE:
            raise ConfigError(f"dtype={self.dtype} is not supported; use uint8, uint16 or float32")
        if height < 1 or width < 1:
            raise ConfigError(f"scene size {height}x{width} must be positive")
        self.seed, self.height, self.width, self.bands = int(seed), height, width, bands
        self._key = int(_hash(self.seed, 0x5EED))

    def __repr__(self) -> str:
        return (f"SceneGenerator(seed={self.seed}, height={self.height}, width={self.width}, "
                f"bands={self.bands}, dtype={self.dtype.name})")

    @property
    def shape(self) -> tuple[int, int, int]:
        """Image shape ``(bands, height, width)``."""
        return self.bands, self.height, self.width

    def render(self, window: Window) -> tuple[np.ndarray, np.ndarray]:
        """Render image and mask of a window (any position, even outside the scene).

        Args:
            window: pixels to render, absolute scene coordinates.

        Returns:
            ``(image [bands, h, w] dtype, mask [h, w] uint8 class indices)``.
        """
        image = np.empty((self.bands, window.height, window.width), self.dtype)
        mask = np.empty((window.height, window.width), np.uint8)
        for block in _blocks(window):
            rows, cols = block.shift(-window.row, -window.col).slices()
            look = self._look(block)
            self._paint_image(image[:, rows, cols], look, block)
            mask[rows, cols] = _mask_from_look(look)
        return image, mask

    def render_mask(self, window: Window) -> np.ndarray:
        """Render only the mask of a window: ``[h, w]`` uint8, equal to ``render()[1]``."""
        mask = np.empty((window.height, window.width), np.uint8)
        for block in _blocks(window):
            mask[block.shift(-window.row, -window.col).slices()] = _mask_from_look(
                self._look(block))
        return mask

    def _paint_image(self, out: np.ndarray, look: np.ndarray, window: Window) -> None:
        """Fill ``out [bands, h, w]``: colour of the look x illumination + pixel noise."""
        light = _field(self._key, "light", window)
        light *= np.float32(0.36)
        light += np.float32(0.82)  # illumination factor in about [0.82, 1.18]
        index = look.astype(np.intp)
        band = np.empty(look.shape, np.float32)
        noise = np.empty(0, np.uint8)
        for c in range(self.bands):
            if c % 4 == 0:  # 4 bytes of hash per pixel: 4 bands of noise
                noise = self._pixel_noise(window, c // 4)
            _COLOURS[:, c].take(index, out=band)
            band *= light
            band += noise[:, :, c % 4]  # triangular noise in 0..30, sigma 6.5
            band -= np.float32(14.5)  # centre the noise; +0.5 rounds on the cast below
            np.clip(band, 0.0, 255.0, out=band)
            if self.dtype == np.uint8:
                out[c] = band  # the cast truncates
            else:
                out[c] = np.floor(band) * np.float32(_DTYPE_SCALE[self.dtype])

    def _pixel_noise(self, window: Window, salt: int) -> np.ndarray:
        """Hash every pixel to 4 bytes of triangular noise in ``0..30``: ``[h, w, 4]`` uint8."""
        k = int(_hash(self._key, 0x9A5, salt))
        with np.errstate(over="ignore"):
            rows = np.arange(window.row, window.row_end).astype(np.uint32) * np.uint32(0x9E3779B1)
            cols = np.arange(window.col, window.col_end).astype(np.uint32) * np.uint32(0x85EBCA77)
            rows = _mix32(rows ^ np.uint32(k & 0xFFFFFFFF))
            cols = _mix32(cols ^ np.uint32(k >> 32))
            h = _mix32(rows[:, None] ^ cols[None, :])
        high = h >> 4  # sum of the two nibbles of each byte (no carries across bytes)
        high &= np.uint32(0x0F0F0F0F)
        h &= np.uint32(0x0F0F0F0F)
        h += high
        return h.view(np.uint8).reshape(window.height, window.width, 4)

    def _look(self, window: Window) -> np.ndarray:
        """Compute the appearance (class index or ``SHADOW``) per pixel: ``[h, w]`` uint8."""
        look = (_field(self._key, "vegetation", window) > _VEGETATION_ABOVE).view(np.uint8)
        water = (_field(self._key, "water", window) < _WATER_BELOW).view(np.uint8)
        water *= np.uint8(WATER)
        np.maximum(look, water, out=look)
        roads, shadows, buildings = self._city(window)
        roads.paint(look, window, ROAD, over_water=True)  # bridges
        shadows.paint(look, window, SHADOW, over_water=False)
        buildings.paint(look, window, BUILDING, over_water=True)
        return look

    def _city(self, window: Window) -> tuple[_Rects, _Rects, _Rects]:
        """Return street segments, building shadows and buildings of blocks near a window.

        Block ``(i, j)`` owns the street segment along the top and the left of its interior
        and the buildings inside it; its drawing stays within ``2 * _PITCH`` of its corner,
        so blocks from one before the window to its last are enough.
        """
        bi = np.arange(window.row // _PITCH - 1, (window.row_end - 1) // _PITCH + 1)
        bj = np.arange(window.col // _PITCH - 1, (window.col_end - 1) // _PITCH + 1)
        hy, hw, hmajor = self._streets(1, np.append(bi, bi[-1] + 1))
        vx, vw, vmajor = self._streets(2, np.append(bj, bj[-1] + 1))
        i, j = (a.ravel() for a in np.meshgrid(np.arange(bi.size), np.arange(bj.size),
                                                indexing="ij"))
        top, bottom = hy[i] + hw[i], hy[i + 1]  # block interior, between the streets
        left, right = vx[j] + vw[j], vx[j + 1]
        urban = _noise_points(self._key, "urban", (top + bottom) // 2, (left + right) // 2)
        urban = np.clip((urban - 0.3) / 0.4, 0.0, 1.0)
        p_street = 0.3 + 0.7 * urban  # minor streets thin out in the countryside
        h_on = hmajor[i] | (_uniform(self._key, 3, bi[i], bj[j]) < p_street)
        v_on = vmajor[j] | (_uniform(self._key, 4, bi[i], bj[j]) < p_street)
        streets = (_Rects(hy[i], top, vx[j], right + vw[j + 1]).select(h_on)
                   + _Rects(hy[i], bottom + hw[i + 1], vx[j], left).select(v_on))
        shadows, buildings = self._buildings(bi[i], bj[j], (top, bottom, left, right), urban)
        return streets, shadows, buildings

    def _streets(self, axis: int, idx: np.ndarray) -> tuple[np.ndarray, ...]:
        """Return position, width and 'major' flag of street lines ``idx`` along an axis."""
        u = _uniform(self._key, 10 + axis, idx[:, None], np.arange(3)[None, :])
        major = u[:, 2] < 0.25  # major streets run through the countryside too
        width = np.where(major, 7 + 2 * u[:, 1], 4 + 4 * u[:, 1]).astype(np.int64)
        return idx * _PITCH + (u[:, 0] * 20).astype(np.int64), width, major

    def _buildings(self, bi: np.ndarray, bj: np.ndarray, box: tuple[np.ndarray, ...],
                   urban: np.ndarray) -> tuple[_Rects, _Rects]:
        """Return shadows and buildings: up to ``_MAX_BUILDINGS`` rectangles per block."""
        top, bottom, left, right = (b[:, None] for b in box)
        slot = np.arange(_MAX_BUILDINGS)[None, :]
        u = _uniform(self._key, 5, bi[:, None, None], bj[:, None, None], slot[..., None],
                     np.arange(5)[None, None, :])
        height = 10 + (u[..., 0] * 27).astype(np.int64)  # 10..36 px, aspect <= 2.5
        width = np.clip(10 + (u[..., 1] * 27).astype(np.int64), height * 2 // 5, height * 5 // 2)
        shade = 2 + (u[..., 2] * 4).astype(np.int64)  # shadow offset towards +row, +col
        margin = 3  # off the streets, so shadows fall on the ground of the block
        span_r = bottom - top - 2 * margin - shade - height
        span_c = right - left - 2 * margin - shade - width
        r0 = top + margin + (u[..., 3] * np.maximum(span_r, 0)).astype(np.int64)
        c0 = left + margin + (u[..., 4] * np.maximum(span_c, 0)).astype(np.int64)
        keep = (slot < urban[:, None] * (_MAX_BUILDINGS + 1) - 0.5) & (span_r >= 0) & (span_c >= 0)
        r0, c0, height, width, shade = (a[keep] for a in (r0, c0, height, width, shade))
        r1, c1 = r0 + height + shade, c0 + width + shade
        ys = np.stack([r0, r0, r1, r1, (r0 + r1) // 2])  # corners and centre stay dry
        xs = np.stack([c0, c1, c0, c1, (c0 + c1) // 2])
        dry = (_noise_points(self._key, "water", ys, xs) > _WATER_BELOW + 0.04).all(axis=0)
        r0, c0, r1, c1, shade = (a[dry] for a in (r0, c0, r1, c1, shade))
        return _Rects(r0 + shade, r1, c0 + shade, c1), _Rects(r0, r1 - shade, c0, c1 - shade)


def _blocks(window: Window) -> list[Window]:
    """Cut a window into blocks of at most ``_BLOCK x _BLOCK`` px, row-major."""
    return [Window(r, c, min(_BLOCK, window.row_end - r), min(_BLOCK, window.col_end - c))
            for r in range(window.row, window.row_end, _BLOCK)
            for c in range(window.col, window.col_end, _BLOCK)]


def _mask_from_look(look: np.ndarray) -> np.ndarray:
    """Turn appearance into class indices in place: shadows are background."""
    return np.multiply(look, look != SHADOW, out=look)


# -- writing scenes and datasets ----------------------------------------------------------
