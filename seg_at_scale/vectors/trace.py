"""Polygons of the 4-connected regions of a label strip, traced on its runs.

The same polygons as GDAL's polygonizer (``rasterio.features.shapes`` with
4-connectivity), ring for ring and vertex for vertex up to where each ring starts, and
oriented like GDAL's (a shell's signed area negative in raw coordinates, a hole's
positive), but built without a Python object per vertex: ``rasterio.features.shapes``
hands back GeoJSON-like dicts of coordinate tuples (on fragmented labels that alone took
longer than all of this module, which is vectorised throughout).

A *run* is a row's longest stretch of one class. Its region's boundary is made of

* vertical edges at both ends of every run (a run ends where the class changes), and
* horizontal edges on each line between two rows, along the stretches where the region
  above differs from the one below (the stretches between the runs' ends of both rows),

each directed with its region on one side, and merged with its collinear neighbours into
maximal sides. A region's sides join end to start at their corners; where two sides of one
region arrive at a corner (its pixels meet there only diagonally) the *wide* join is taken
(:mod:`seg_at_scale.vectors.stitch` says why: rings stay simple, a hole touches the shell
at that point). The joined cycles are the rings: one shell per region (the pixels of a
region are 4-connected) and holes. The work is a few sorts of the runs and edges.
"""

from __future__ import annotations

import numpy as np
import shapely

from seg_at_scale.vectors.stitch import _cycles, _ranges

__all__ = ["trace"]


def _merge(part: np.ndarray, line: np.ndarray, a: np.ndarray, b: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Merge unit-or-longer collinear edges ``[a, b)`` along ``line`` of one part.

    An edge continues the one before it (in the order given) when it has its part and
    line and starts where that one ends; the edges must come so that each one's
    continuation follows it. Returns the merged (part, line, a, b).
    """
    cont = np.zeros(part.size, bool)
    cont[1:] = (part[1:] == part[:-1]) & (line[1:] == line[:-1]) & (a[1:] == b[:-1])
    first = np.flatnonzero(~cont)
    last = np.r_[first[1:], part.size] - 1
    return part[first], line[first], a[first], b[last]


def trace(starts: np.ndarray, run_part: np.ndarray, height: int, width: int, parts: int,
          row: int = 0) -> np.ndarray:
    """One Polygon per region of a strip, from its runs.

    Args:
        starts: ``[R]`` flat index of every run's first pixel (all runs of the strip,
            no-data runs too, in order; each row begins a run).
        run_part: ``[R]`` region of each run, ``0..parts-1``, or -1 for no data; a
            region's runs are 4-connected.
        height: the strip's rows.
        width: the strip's columns.
        parts: the number of regions.
        row: the strip's first row in the raster (added to every y).

    Returns:
        object array ``[parts]`` of Polygons in raster pixel coordinates.
    """
    if not parts:
        return np.zeros(0, object)
    h, w = height, width
    r_row = starts // w
    c0 = starts - r_row * w
    c1 = np.r_[c0[1:], w]
    c1[np.r_[r_row[1:] != r_row[:-1], True]] = w  # a row's last run ends at the border
    valid = run_part >= 0

    # vertical sides: a region's left end goes down, its right end up (GDAL's turn); one
    # run starts (ends) at a column in a row, so (column, row) orders them down columns
    q, y = run_part[valid], r_row[valid]
    order = np.argsort(c0[valid] * h + y)
    lq, lx, ly0, ly1 = _merge(q[order], c0[valid][order], y[order], y[order] + 1)
    order = np.argsort(c1[valid] * h + y)
    rq, rx, ry0, ry1 = _merge(q[order], c1[valid][order], y[order], y[order] + 1)

    # horizontal sides: on line y (0..h) the stretches between the run ends of rows
    # y - 1 and y; where the region above differs from the one below, each gets a side.
    # The runs' starts as seen from the line below them and from the line above them
    # are two sorted lists: merged, they give each stretch its run above and below
    below_key = r_row * (w + 1) + c0
    above_key = below_key + (w + 1)
    merged = np.concatenate([below_key, above_key])
    order = np.argsort(merged)  # ties: counted below as a whole
    keys = merged[order]
    is_below = order < below_key.size
    below_run = np.cumsum(is_below) - 1  # the last run start of the row below, so far
    above_run = np.cumsum(~is_below) - 1
    last = np.r_[keys[1:] != keys[:-1], True]  # one stretch per distinct key: its last
    keys, below_run, above_run = keys[last], below_run[last], above_run[last]
    line, xa = keys // (w + 1), keys % (w + 1)
    xb = np.r_[xa[1:], w]
    xb[np.r_[line[1:] != line[:-1], True]] = w
    below = np.where(line <= h - 1, run_part[np.maximum(below_run, 0)], -1)
    above = np.where(line >= 1, run_part[np.maximum(above_run, 0)], -1)
    edge = above != below
    sel = edge & (above >= 0)  # the bottom of the region above: +x
    bq, by, bx0, bx1 = _merge(above[sel], line[sel], xa[sel], xb[sel])
    sel = edge & (below >= 0)  # the top of the region below: -x
    tq, ty, tx0, tx1 = _merge(below[sel], line[sel], xa[sel], xb[sel])

    # every side as (part, from, to, direction); GDAL's orientation
    part = np.concatenate([lq, rq, bq, tq])
    fx = np.concatenate([lx, rx, bx0, tx1])
    fy = np.concatenate([ly0, ry1, by, ty])
    tx = np.concatenate([lx, rx, bx1, tx0])
    ty_ = np.concatenate([ly1, ry0, by, ty])
    dx, dy = np.sign(tx - fx), np.sign(ty_ - fy)
    # one sort of both ends: at each corner the sides leaving it, then those arriving
    n = part.size
    corner = np.concatenate([fy * (w + 1) + fx, ty_ * (w + 1) + tx])
    owner = np.concatenate([part, part])
    arrives = np.r_[np.zeros(n, np.int64), np.ones(n, np.int64)]
    stride = (h + 1) * (w + 1)
    if 2 * (parts + 1) * stride < 2**62:  # one int64 key
        ends = (owner * stride + corner) * 2 + arrives
        by_key = np.argsort(ends)
        key = ends[by_key] >> 1
        new = np.r_[True, key[1:] != key[:-1]]
    else:  # a strip of billions of pixels: sort on the columns
        by_key = np.lexsort((arrives, corner, owner))
        o, k = owner[by_key], corner[by_key]
        new = np.r_[True, (o[1:] != o[:-1]) | (k[1:] != k[:-1])]
    group = np.cumsum(new) - 1
    start = np.flatnonzero(new)
    size = np.diff(np.r_[start, 2 * n])
    at = np.flatnonzero(by_key >= n)  # where the arriving ends lie
    g = group[at]
    if ((size != 2) & (size != 4)).any():
        raise AssertionError("sides do not meet two by two at the corners")
    arriving = by_key[at] - n
    nxt = np.empty(n, np.int64)
    nxt[arriving] = by_key[start[g]]
    pinch = size[g] == 4  # two sides of one region leave this corner
    if pinch.any():
        i, cand = arriving[pinch], by_key[start[g[pinch]]]
        turn = dx[i] * dy[cand] - dy[i] * dx[cand]
        nxt[i] = np.where(turn == 1, cand, by_key[start[g[pinch]] + 1])  # the wide join
    order, ring = _cycles(nxt)

    # rings: their corners in order; shell (negative area) first, then the holes
    vx, vy = fx[order], fy[order]
    n_rings = int(ring.max(initial=-1)) + 1
    size = np.bincount(ring, minlength=n_rings)
    off = np.cumsum(size) - size
    succ = off[ring] + (np.arange(ring.size) - off[ring] + 1) % size[ring]
    area2 = np.bincount(ring, vx * vy[succ] - vx[succ] * vy, n_rings)
    ring_part = np.zeros(n_rings, np.int64)
    ring_part[ring] = part[order]
    hole = area2 > 0
    if (np.bincount(ring_part[~hole], minlength=parts) != 1).any():
        raise AssertionError("a region traced to other than one shell")
    arrange = np.lexsort((hole, ring_part))
    closed = size[arrange] + 1
    local = _ranges(np.zeros(n_rings, np.int64), closed)
    index = np.repeat(off[arrange], closed) + local % np.repeat(size[arrange], closed)
    xy = np.column_stack([vx[index], vy[index] + row]).astype(np.float64)
    ring_off = np.zeros(n_rings + 1, np.int64)
    np.cumsum(closed, out=ring_off[1:])
    poly_off = np.zeros(parts + 1, np.int64)
    np.cumsum(np.bincount(ring_part, minlength=parts), out=poly_off[1:])
    return shapely.from_ragged_array(shapely.GeometryType.POLYGON, xy, (ring_off, poly_off))
