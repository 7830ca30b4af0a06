"""Coverage simplification of the regions: neighbours keep one shared, simplified edge.

``shapely.coverage_simplify`` simplifies each edge shared by two polygons once, so no gap
or overlap opens between neighbours (per-polygon ``simplify`` moves the two sides of an
edge differently). It needs an *edge-matched* coverage: along a shared edge both polygons
have the same vertices. GDAL leaves out a vertex where a third region meets the straight
side of a polygon (a T junction), so :func:`edge_matched` first inserts into every edge
each polygon vertex lying inside it. All coordinates are integer pixel corners and all
edges are horizontal or vertical, so this is exact and needs only sorting.

>>> a = shapely.box(0, 0, 2, 1)  # below it, b and c meet at x = 1
>>> b, c = shapely.box(0, 1, 1, 2), shapely.box(1, 1, 2, 2)
>>> bool(shapely.coverage_is_valid([a, b, c]))
False
>>> fixed = edge_matched(np.array([a, b, c]))
>>> bool(shapely.coverage_is_valid(fixed)), fixed[0].equals(a)
(True, True)
"""

from __future__ import annotations

import numpy as np
import shapely

__all__ = ["edge_matched", "coverage_simplified"]


def edge_matched(geometries: np.ndarray) -> np.ndarray:
    """The polygons with every vertex of any of them inserted into the edges it lies on.

    Args:
        geometries: ``[N]`` Polygons / MultiPolygons in pixel coordinates (integer
            vertices, axis-parallel edges).

    Returns:
        ``[N]`` geometries of the same point sets and types, edge-matched.
    """
    parts, part_of = shapely.get_parts(geometries, return_index=True)
    rings, ring_of = shapely.get_rings(parts, return_index=True)
    xy, vertex_of = shapely.get_coordinates(rings, return_index=True)
    nodes = np.unique(xy.astype(np.int64), axis=0)
    start, end = xy[:-1].astype(np.int64), xy[1:].astype(np.int64)
    same_ring = vertex_of[:-1] == vertex_of[1:]
    start, end, edge_ring = start[same_ring], end[same_ring], vertex_of[:-1][same_ring]
    inside = [_inside(nodes, start, end, axis) for axis in (0, 1)]  # horizontal, vertical
    counts = inside[0][1] - inside[0][0] + inside[1][1] - inside[1][0]
    # each edge contributes its start and the nodes inside it; each ring then closes
    out_len = len(start) + int(counts.sum())
    first = np.concatenate([[0], np.cumsum(counts + 1)[:-1]])
    coords = np.empty((out_len, 2), np.float64)
    owner = np.empty(out_len, np.int64)
    coords[first], owner[first] = start, edge_ring
    for axis in (0, 1):
        lo, hi, order = inside[axis]
        n = hi - lo
        if not n.any():
            continue
        edge = np.repeat(np.arange(len(start)), n)
        step = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # 0.. n-1 per edge
        forward = np.repeat(end[:, axis] > start[:, axis], n)
        pick = np.where(forward, np.repeat(lo, n) + step, np.repeat(hi, n) - 1 - step)
        coords[first[edge] + 1 + step] = nodes[order[pick]]
        owner[first[edge] + 1 + step] = edge_ring[edge]
    closed = _close_rings(coords, owner)
    new_rings = shapely.linearrings(closed[0], indices=closed[1])
    polygons = shapely.polygons(new_rings, indices=ring_of)
    return _regroup(geometries, polygons, part_of)


def _inside(nodes: np.ndarray, start: np.ndarray, end: np.ndarray, axis: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For edges along ``axis`` (0: x varies), the node range strictly inside each edge.

    Returns ``(lo, hi, order)``: nodes ``order[lo:hi]`` (sorted along the edge) lie inside;
    ``lo == hi`` for edges along the other axis.
    """
    other = 1 - axis
    order = np.lexsort((nodes[:, axis], nodes[:, other]))  # by line, then along it
    span = np.int64(1) << 32  # coordinates are pixel corners: far below 2^31
    key = nodes[order, other] * span + nodes[order, axis]
    along = (start[:, other] == end[:, other]) & (start[:, axis] != end[:, axis])
    a = np.minimum(start[:, axis], end[:, axis])
    b = np.maximum(start[:, axis], end[:, axis])
    lo = np.searchsorted(key, start[:, other] * span + a, side="right")
    hi = np.searchsorted(key, start[:, other] * span + b, side="left")
    lo, hi = np.where(along, lo, 0), np.where(along, hi, 0)
    return lo, np.maximum(hi, lo), order


def _close_rings(coords: np.ndarray, owner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Append each ring's first point after its last (rings are given open)."""
    starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
    ends = np.r_[starts[1:], len(owner)]
    where = np.insert(np.arange(len(owner)), ends, -1)
    out = np.empty((len(where), 2))
    out[where >= 0] = coords
    out[where < 0] = coords[starts]
    ids = np.insert(owner, ends, owner[starts])
    return out, ids


def _regroup(original: np.ndarray, polygons: np.ndarray, part_of: np.ndarray) -> np.ndarray:
    """Polygons back into the original geometries (MultiPolygons stay multi)."""
    multi = shapely.multipolygons(polygons, indices=part_of)
    single = shapely.get_type_id(original) == shapely.GeometryType.POLYGON
    out = multi.copy()
    out[single] = shapely.get_geometry(multi[single], 0)
    return out


def coverage_simplified(geometries: np.ndarray, tolerance_pixels: float) -> np.ndarray:
    """``shapely.coverage_simplify`` of the regions, in pixel coordinates.

    Args:
        geometries: ``[N]`` regions of one raster (pixel coordinates).
        tolerance_pixels: roughly the side of the largest triangle removed, in pixels.
    """
    if len(geometries) == 0:
        return geometries
    return shapely.coverage_simplify(edge_matched(geometries), tolerance_pixels)
