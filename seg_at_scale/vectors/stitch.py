"""The union of polygon pieces that meet along horizontal seams, without an overlay.

The polygonizer reads a raster in strips; a region that crosses a seam comes in pieces,
polygons on the pixel lattice oriented as GDAL's (:mod:`~seg_at_scale.vectors.trace`),
which share stretches of the seam lines and, within a strip, at most corner points.
Their union is found here on the rings themselves, vectorised over every region closing
at once, in time about linear in their vertices (``shapely.union_all`` is an overlay: on
the large smooth regions of a real scene it cost more than polygonizing them):

1. every ring edge that lies on a seam line is cut at the seam-line vertices of the same
   region (both sides), and the stretches that both sides hold cancel (they run in
   opposite directions: the region lies on one side of each ring);
2. what is left of the rings that touched a seam is a set of *links*: the runs of edges
   between seam-line vertices and corners where two pieces of one strip meet (kept in
   order), and the seam stretches that did not cancel;
3. links are joined end to start at those vertices. Where two links arrive at
   one vertex (the region's pixels meet only at that corner, diagonally) the *wide* join
   is taken, the one that turns away from those two pixels: the pieces make one
   4-connected region, so the two free corners lie in different holes (or one outside),
   and this join keeps every ring simple (OGC lets a hole touch the shell at a point, a
   ring may not touch itself);
4. the joined rings keep GDAL's orientation (shells negative area, holes positive), so
   each region gets exactly one shell, and its holes are the joined rings of positive area
   plus the pieces' holes that touch no seam.

Collinear vertices left where links meet are dropped, so the rings hold only corners, as
GDAL's do: the result equals GDAL's polygon of the whole region, vertex for vertex up to
where each ring starts (``tests/vectors/test_vectors_fragmented.py``).
"""

from __future__ import annotations

import numpy as np
import shapely

__all__ = ["StitchError", "stitch"]

#: About one element in this many starts a walk when ordering cycles (:func:`_cycles`).
SPACING = 16


class StitchError(ValueError):
    """The pieces are not what :func:`stitch` expects (lattice polygons meeting on seams)."""


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])``, vectorised."""
    lengths = np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    return np.repeat(np.asarray(starts, np.int64) - np.cumsum(lengths) + lengths,
                     lengths) + np.arange(total)


def _cycles(nxt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cycles of the permutation ``nxt``.

    Returns its elements cycle by cycle, each cycle in its order (from some element),
    and the cycle (``0..c-1``) of each position.

    The cycles are labelled as the connected components of a graph
    (``scipy.sparse.csgraph``); then every cycle's first element and about one element in
    ``SPACING`` (spread as at random) are *rulers*: all walk forward at once to the next ruler,
    which numbers the elements between them, and the rulers' own positions come from
    pointer jumping over the rulers only (log2 of the longest cycle's ruler count).
    """
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import connected_components

    n = nxt.size
    if not n:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    index = np.arange(n)
    graph = csr_matrix((np.ones(n, np.int8), (index, nxt)), shape=(n, n))
    count, label = connected_components(graph, directed=True, connection="weak")
    first = np.empty(count, np.int64)
    first[label] = index  # some element of each cycle
    ruler = (index * 0x9E3779B1 >> 11) % SPACING == 0  # spread like random, repeatable
    ruler[first] = True
    rulers = np.flatnonzero(ruler)
    which = np.full(n, -1, np.int64)  # the ruler each element follows, and how far
    which[rulers] = np.arange(rulers.size)
    steps = np.zeros(n, np.int64)
    walker = np.arange(rulers.size)
    at = nxt[rulers]
    gone = 1
    while walker.size:
        off = ~ruler[at]
        walker, at = walker[off], at[off]
        which[at] = walker
        steps[at] = gone
        at = nxt[at]
        gone += 1
    # the next ruler of each ruler and the steps to it
    tail = np.flatnonzero(~ruler & ruler[nxt])  # last element before a ruler
    gap = np.ones(rulers.size, np.int64)
    nxt_ruler = which[nxt[rulers]]  # rulers right after a ruler
    gap[which[tail]] = steps[tail] + 1
    nxt_ruler[which[tail]] = which[nxt[tail]]
    # each ruler's distance forward to its cycle's first (list ranking over the rulers)
    head = rulers == first[label[rulers]]
    dist = np.where(head, 0, gap)
    jump = np.where(head, np.arange(rulers.size), nxt_ruler)
    live = np.flatnonzero(~head[jump])
    while live.size:
        j = jump[live]
        add, jump_j = dist[j], jump[j]
        dist[live] += add
        jump[live] = jump_j
        live = live[~head[jump_j]]
    size = np.bincount(label, minlength=count)
    ruler_cycle = label[rulers]
    ruler_pos = np.where(head, 0, size[ruler_cycle] - dist)
    off = np.cumsum(size) - size
    position = off[label] + ruler_pos[which] + steps
    order = np.empty(n, np.int64)
    order[position] = index
    return order, np.repeat(np.arange(count), size)


def stitch(pieces: np.ndarray, owner: np.ndarray, seams: np.ndarray) -> np.ndarray:
    """The union of the pieces of each region, as one Polygon each.

    Args:
        pieces: object array of Polygons with integer coordinates, oriented like GDAL's
            (a shell's signed area, in raw coordinates, is negative; a hole's positive).
        owner: ``[len(pieces)]`` region of each piece, ``0..k-1``, every one present;
            the pieces of a region make one 4-connected set of pixels.
        seams: the y of the seam lines (pieces meet only along these).

    Returns:
        object array ``[k]`` of Polygons.

    Raises:
        StitchError: on pieces that break these assumptions (``shapely.union_all`` gives
            the same polygons, slower).
    """
    owner = np.asarray(owner, np.int64)
    k = int(owner.max(initial=-1)) + 1
    if not len(pieces):
        return np.zeros(0, object)
    kind, xy, (ring_off, poly_off) = shapely.to_ragged_array(pieces)
    if kind != shapely.GeometryType.POLYGON:
        raise StitchError(f"pieces are {kind!r}, not Polygons")
    n_rings = ring_off.size - 1
    ring_len = np.diff(ring_off)  # vertices, the closing one included
    ring_part = owner[np.repeat(np.arange(poly_off.size - 1), np.diff(poly_off))]
    is_shell = np.zeros(n_rings, bool)
    is_shell[poly_off[:-1]] = True
    # edge e runs from vertex start[e] to start[e] + 1 (the last vertex of a ring starts none)
    ring_of_edge = np.repeat(np.arange(n_rings), ring_len - 1)
    edge_off = ring_off - np.arange(n_rings + 1)
    start = np.arange(int(edge_off[-1])) + ring_of_edge
    x0, y0 = xy[start, 0], xy[start, 1]
    dx, dy = np.sign(xy[start + 1, 0] - x0), np.sign(xy[start + 1, 1] - y0)
    area2 = np.bincount(ring_of_edge, x0 * xy[start + 1, 1] - xy[start + 1, 0] * y0, n_rings)
    if (area2[is_shell] >= 0).any() or (area2[~is_shell] <= 0).any():
        raise StitchError("rings not oriented like GDAL's (shells negative, holes positive)")
    on_seam = (dy == 0) & np.isin(y0, seams)
    touched = np.bincount(ring_of_edge[on_seam], minlength=n_rings) > 0
    if not touched[is_shell].all():
        raise StitchError("a piece's shell touches no seam: pieces not joined along seams")

    # the vertices of the rings that touch a seam, one id per region and point; those
    # held twice are where two pieces of one strip meet at a corner (or a piece's hole
    # touches its shell): links end there too
    rings = np.flatnonzero(touched)
    own = _ranges(ring_off[rings], ring_len[rings] - 1)
    part_v = np.repeat(ring_part[rings], ring_len[rings] - 1)
    y_v, x_v = xy[own, 1].astype(np.int64), xy[own, 0].astype(np.int64)
    height = int(y_v.max(initial=0)) + 1
    lines, line_v = np.unique(part_v * height + y_v, return_inverse=True)
    width = int(x_v.max(initial=0)) + 1
    breaks, vid_v, held_v = np.unique(line_v * width + x_v, return_inverse=True,
                                      return_counts=True)
    vid = np.full(xy.shape[0], -1, np.int64)
    vid[own] = vid_v
    vid[ring_off[rings + 1] - 1] = vid[ring_off[rings]]  # closing vertices
    cut = held_v >= 2

    # 1. seam edges cut at their region's vertices on that line; shared stretches cancel
    seam_edges = np.flatnonzero(on_seam)
    part_e = ring_part[ring_of_edge[seam_edges]]
    ia, ib = vid[start[seam_edges]], vid[start[seam_edges] + 1]
    count = np.abs(ib - ia)  # ids of one line are consecutive, ordered by x
    which = np.repeat(np.arange(seam_edges.size), count)
    step = _ranges(np.zeros(count.size, np.int64), count)
    forward = (ib > ia)[which]
    left = np.where(forward, ia[which] + step, ia[which] - 1 - step)  # breaks[left, left+1]
    held = np.bincount(left, minlength=breaks.size)
    if held.max(initial=0) > 2:
        raise StitchError("a seam stretch held by more than two rings: pieces overlap")
    free = held[left] == 1
    sub_from = np.where(forward, left, left + 1)[free]
    sub_to = np.where(forward, left + 1, left)[free]
    sub_dx = np.where(forward, 1, -1)[free]
    sub_part = part_e[which[free]]

    # 2. links: runs of plain (non-seam) edges between seam edges and shared vertices,
    # each touched ring rolled to begin with a seam edge; then the free seam stretches
    first_seam = np.full(n_rings, -1, np.int64)
    seam_rings, first = np.unique(ring_of_edge[seam_edges], return_index=True)
    first_seam[seam_rings] = seam_edges[first]
    n_edges = ring_len[rings] - 1
    local = _ranges(np.zeros(rings.size, np.int64), n_edges)
    seq_ring = np.repeat(np.arange(rings.size), n_edges)
    seq = edge_off[rings][seq_ring] + (local + first_seam[rings][seq_ring]
                                       - edge_off[rings][seq_ring]) % n_edges[seq_ring]
    plain = ~on_seam[seq]
    begin, end = vid[start[seq]], vid[start[seq] + 1]
    heads = np.flatnonzero(plain & (~np.r_[False, plain[:-1]] | cut[begin]))
    tails = np.flatnonzero(plain & (~np.r_[plain[1:], False] | cut[end]))
    link_from = np.concatenate([begin[heads], sub_from])
    link_to = np.concatenate([end[tails], sub_to])
    n_links = link_from.size
    first_d = np.column_stack([np.r_[dx[seq[heads]], sub_dx],
                               np.r_[dy[seq[heads]], np.zeros(sub_dx.size)]])
    last_d = np.column_stack([np.r_[dx[seq[tails]], sub_dx],
                              np.r_[dy[seq[tails]], np.zeros(sub_dx.size)]])
    link_part = np.r_[ring_part[rings[seq_ring[heads]]], sub_part]

    # 3. each link's end joins the link leaving that vertex; of two, the wide join
    leaving = np.bincount(link_from, minlength=breaks.size)
    if (leaving != np.bincount(link_to, minlength=breaks.size)).any() or \
            leaving.max(initial=0) > 2:
        raise StitchError("seam vertices with unbalanced links")
    by_start = np.argsort(link_from, kind="stable")
    first_out = np.cumsum(leaving) - leaving
    nxt = by_start[first_out[link_to]]
    pinch = np.flatnonzero(leaving[link_to] == 2)
    if pinch.size:
        other = by_start[first_out[link_to[pinch]] + 1]
        a, b = last_d[pinch], first_d[nxt[pinch]]
        # GDAL's orientation (shells negative): the wide join turns +1 (a x b)
        nxt[pinch] = np.where(a[:, 0] * b[:, 1] - a[:, 1] * b[:, 0] == 1, nxt[pinch], other)
    if n_links and np.bincount(nxt, minlength=n_links).max() != 1:
        raise StitchError("links do not join into rings")
    if (link_part[nxt] != link_part).any():
        raise StitchError("a ring runs through two regions")
    order, ring_id = _cycles(nxt)

    # the joined rings' vertices: a run's edges' starts, a free stretch's start
    plain_pos = np.flatnonzero(plain)
    pool = np.concatenate([
        xy[start[seq[plain_pos]]],
        np.column_stack([breaks[sub_from] % width,
                         lines[breaks[sub_from] // width] % height]).astype(xy.dtype)])
    body_len = np.r_[tails - heads + 1, np.ones(sub_from.size, np.int64)]
    body_off = np.r_[np.searchsorted(plain_pos, heads),
                     plain_pos.size + np.arange(sub_from.size)]
    lens = body_len[order]
    vx = pool[_ranges(body_off[order], lens)]
    vring = np.repeat(ring_id, lens)
    n_new = int(ring_id.max(initial=-1)) + 1
    new_part = np.zeros(n_new, np.int64)
    new_part[ring_id] = link_part[order]
    # drop collinear vertices (where links met), cyclically within each ring
    n_v = np.bincount(vring, minlength=n_new)
    v_off = np.cumsum(n_v) - n_v
    pos = np.arange(vring.size) - v_off[vring]
    prev = v_off[vring] + (pos - 1) % n_v[vring]
    succ = v_off[vring] + (pos + 1) % n_v[vring]
    d1, d2 = vx - vx[prev], vx[succ] - vx
    keep = d1[:, 0] * d2[:, 1] - d1[:, 1] * d2[:, 0] != 0
    vx, vring = vx[keep], vring[keep]
    n_v = np.bincount(vring, minlength=n_new)
    v_off = np.cumsum(n_v) - n_v
    nxt_v = v_off[vring] + (np.arange(vring.size) - v_off[vring] + 1) % n_v[vring]
    new_area2 = np.bincount(vring, vx[:, 0] * vx[nxt_v, 1] - vx[nxt_v, 0] * vx[:, 1], n_new)
    new_shell = new_area2 < 0
    if (np.bincount(new_part[new_shell], minlength=k) != 1).any():
        raise StitchError("a region's rings do not make exactly one shell")

    # 4. polygons: each region's shell, then its holes (joined ones, then untouched ones)
    j = _ranges(np.zeros(n_new, np.int64), n_v + 1)  # 0..n: the ring closed
    closed = vx[np.repeat(v_off, n_v + 1) + j % np.repeat(n_v, n_v + 1)]
    untouched = np.flatnonzero(~touched)  # holes away from the seams
    all_xy = np.concatenate([closed, xy])
    r_off = np.r_[v_off + np.arange(n_new), closed.shape[0] + ring_off[untouched]]
    r_len = np.r_[n_v + 1, ring_len[untouched]]
    r_part = np.r_[new_part, ring_part[untouched]]
    r_hole = np.r_[~new_shell, np.ones(untouched.size, bool)]
    arrange = np.lexsort((r_hole, r_part))
    out_xy = all_xy[_ranges(r_off[arrange], r_len[arrange])]
    out_ring_off = np.zeros(arrange.size + 1, np.int64)
    np.cumsum(r_len[arrange], out=out_ring_off[1:])
    out_poly_off = np.zeros(k + 1, np.int64)
    np.cumsum(np.bincount(r_part, minlength=k), out=out_poly_off[1:])
    return shapely.from_ragged_array(shapely.GeometryType.POLYGON, out_xy,
                                     (out_ring_off, out_poly_off))
