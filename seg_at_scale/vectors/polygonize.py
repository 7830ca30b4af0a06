"""Polygons of a label raster without seams, read strip by strip, equal to the whole-image result.

Each strip is polygonized on its own, in pixel coordinates (integers, so exact). Its
*runs* (a row's longest stretches of one class) give, in one pass for all classes, the
4-connected components of each class (a graph of runs joined where they overlap between
rows) and their polygons (:mod:`~seg_at_scale.vectors.trace`): the same polygons as GDAL's
polygonizer (``rasterio.features.shapes``) with 4-connectivity, vertex for vertex, but
vectorised, where ``rasterio.features.shapes`` builds a tuple per vertex. Such a polygon
is always valid: its interior is connected, and where it pinches at a corner the rings
split into a shell and a hole touching at that point. Nothing is ever repaired with
``shapely.make_valid``, which is super-linear on fragmented regions (before issue #39, an
8-connected checkerboard of 200² took over 10 minutes in it).

A region is built from its *parts*: its 4-connected pieces. With 4-connectivity a region
is one part; with 8-connectivity a region is its parts joined at corners, and its
geometry is the MultiPolygon of those parts (they share no edge, only corner points, so
the MultiPolygon is valid as assembled).

A part that crosses a strip's lower seam is *open*: its pieces wait until the next strip
says which of its components continue it (the two rows either side of the seam, same
class, vertically adjacent; regions join diagonally too with 8-connectivity). A part none
of whose pixels lie on the current lower seam can grow no more: its pieces, which meet
along seam lines only, are joined ring by ring (:mod:`~seg_at_scale.vectors.stitch`,
linear, no overlay) and its region is yielded as soon as none of its parts is open.
Memory is therefore one strip plus the open regions, not the raster, and the work per
strip is about linear in the strip's pixels, runs and vertices plus the open parts (at
most one per column). Against ``rasterio.features.shapes`` on the whole array it took
0.3-0.7x the time on checkerboards and 50% noise and 0.85-1.35x on smooth labels
(``experiments/bench_polygonize.py``).

The result equals ``rasterio.features.shapes`` on the whole array: one region per
connected region of one class (same count per class), and the same point set, holes
included (``tests/vectors`` prove it on odd sizes with strips of 1 row upwards,
checkerboards and 50% noise included). Geometries are valid: a Polygon, or, for regions
joined only at corners (8-connectivity), a MultiPolygon.

>>> labels = np.array([[1, 1, 0], [0, 1, 0], [0, 0, 1]], np.uint8)
>>> sorted((r.class_id, r.pixels) for r in polygonize(labels, strip_rows=1))
[(0, 2), (0, 3), (1, 1), (1, 3)]
>>> sorted((r.class_id, r.pixels) for r in polygonize(labels, connectivity=8, strip_rows=1))
[(0, 5), (1, 4)]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import shapely

from seg_at_scale.errors import ConfigError, InputError
from seg_at_scale.vectors.sources import (
    NODATA,
    BandReader,
    Source,
    closed_on_error,
    open_labels,
    open_probabilities,
    probability_scale,
    reader_path,
    row_bands,
)
from seg_at_scale.vectors.stitch import StitchError, _ranges, stitch
from seg_at_scale.vectors.trace import trace

__all__ = ["Region", "MergeStats", "SeamMerger", "polygonize", "check_options"]


@dataclass(frozen=True)
class Region:
    """One connected region of one class.

    Attributes:
        class_id: the label value.
        geometry: Polygon (or MultiPolygon with 8-connectivity) in pixel coordinates
            (x = column, y = row, pixel corners on integers).
        pixels: pixel count (= the geometry's area in pixel units).
        probability: mean probability of ``class_id`` over the region, when given.
    """

    class_id: int
    geometry: shapely.Geometry
    pixels: int
    probability: float | None = None


@dataclass
class MergeStats:
    """What streaming cost: strips read and the most regions / pieces held open at once."""

    strips: int = 0
    regions: int = 0
    peak_open_regions: int = 0
    peak_open_pieces: int = 0


@dataclass
class _Sealed:
    """The complete parts of an open region (8-connectivity): polygons and their sums."""

    chunks: list[np.ndarray]  # object arrays of Polygons
    pixels: int = 0
    probability_sum: float = 0.0
    polygons: int = -1  # in all chunks (counted when -1)

    def __post_init__(self) -> None:
        if self.polygons < 0:
            self.polygons = sum(len(c) for c in self.chunks)

    def absorb(self, other: _Sealed) -> None:
        self.chunks.extend(other.chunks)
        self.pixels += other.pixels
        self.probability_sum += other.probability_sum
        self.polygons += other.polygons


def check_options(connectivity: int, classes: Iterable[int] | None,
                  strip_rows: int | None) -> frozenset[int] | None:
    """Validate the polygonizer's options; returns ``classes`` as a set.

    Raises:
        ConfigError: naming the option, the bad value and the accepted values.
    """
    if connectivity not in (4, 8):
        raise ConfigError(f"connectivity={connectivity!r}: use 4 (edge neighbours) or 8 "
                          "(edges and corners)")
    if strip_rows is not None and (not isinstance(strip_rows, int) or strip_rows < 1):
        raise ConfigError(f"strip_rows={strip_rows!r}: use a positive number of rows, or "
                          "None for the default")
    if classes is None:
        return None
    kept = frozenset(int(c) for c in classes)
    bad = sorted(c for c in kept if not 0 <= c < NODATA)
    if bad:
        raise ConfigError(f"classes={sorted(kept)} holds {bad}; class ids are 0..254 "
                          "(255 is no data)")
    return kept


class _Components:
    """The connected components of one class in a strip, found on its runs.

    A run is a row's longest stretch of one class; runs in adjacent rows join where they
    overlap (4-connectivity) or also touch at a corner (8-connectivity): a graph of runs,
    not of pixels, and one pass over the strip for all classes at once (no label image).

    Attributes:
        count: 4-connected components (ids ``0..count-1``).
        classes, pixels, psum: ``[count]`` class, pixel count and probability sum.
        region: ``[count]`` 8-connected component of each (8-connectivity), else None.
        top, bottom: ``[W]`` component id + 1 on the first / last row (0: no data).
        run_starts, run_part: ``[R]`` every run's first pixel (flat index; no-data runs
            too) and its component (-1: no data), for :func:`~.trace.trace`.
    """

    def __init__(self, labels: np.ndarray, probability: np.ndarray | None,
                 connectivity: int) -> None:
        h, w = labels.shape
        flat = labels.ravel()
        start = np.empty((h, w), bool)  # a run starts here
        start[:, 0] = True
        np.not_equal(labels[:, 1:], labels[:, :-1], out=start[:, 1:])
        starts = np.flatnonzero(start)
        run_class = flat[starts]
        lengths = np.diff(starts, append=flat.size)
        kept = run_class != NODATA
        self._starts = starts[kept]
        runs = self._starts.size
        # runs of adjacent rows overlap from a column where one of them starts
        either = start[:-1] | start[1:]
        valid = labels[:-1] != NODATA
        pairs = [np.flatnonzero(either & valid & (labels[:-1] == labels[1:]))]
        a, b = self._run(pairs[0]), self._run(pairs[0] + w)
        part = _connected(runs, [a], [b])
        self.count = int(part.max(initial=-1)) + 1
        self.classes = np.zeros(self.count, np.int64)
        self.classes[part] = run_class[kept]
        self.pixels = np.bincount(part, lengths[kept], self.count).astype(np.int64)
        self.psum = (np.bincount(part, np.add.reduceat(probability.ravel(), starts)[kept],
                                 self.count) if probability is not None and runs
                     else np.zeros(self.count))
        self.region: np.ndarray | None = None
        if connectivity == 8:  # corners: (r, c-1)-(r+1, c) and (r, c)-(r+1, c-1)
            ends = either[:, 1:]
            src, dst = [a], [b]
            for top, bottom, shift in ((np.s_[:-1, :-1], np.s_[1:, 1:], (0, 1)),
                                       (np.s_[:-1, 1:], np.s_[1:, :-1], (1, 0))):
                rc = np.nonzero(ends & (labels[top] != NODATA)
                                & (labels[top] == labels[bottom]))
                src.append(self._run(rc[0] * w + rc[1] + shift[0]))
                dst.append(self._run((rc[0] + 1) * w + rc[1] + shift[1]))
            joined = _connected(runs, src, dst)
            self.region = np.zeros(self.count, np.int64)
            self.region[part] = joined
        self._part = part
        self.run_starts = starts  # every run, no data too
        self.run_part = np.full(starts.size, -1, np.int64)
        self.run_part[kept] = part
        self.top = self._row_ids(labels[0], 0)
        self.bottom = self._row_ids(labels[-1], (h - 1) * w)

    def _run(self, flat_index: np.ndarray) -> np.ndarray:
        """The run holding each pixel (by flat index; pixels with data only)."""
        return np.searchsorted(self._starts, flat_index, side="right") - 1

    def at(self, flat_index: np.ndarray) -> np.ndarray:
        """The component of each pixel (by flat index; pixels with data only)."""
        return self._part[self._run(flat_index)]

    def _row_ids(self, row: np.ndarray, offset: int) -> np.ndarray:
        ids = np.zeros(row.size, np.int64)
        valid = np.flatnonzero(row != NODATA)
        ids[valid] = self.at(offset + valid) + 1
        return ids


class SeamMerger:
    """Turns strips of labels, top to bottom, into finished regions (see module docstring).

    Between strips it holds arrays: the *open parts* (4-connected pieces of a class with a
    pixel on the last row read: class, pixels, probability sum, open region) and their
    polygon pieces; with 8-connectivity also each open region's complete parts.

    Args:
        width: raster columns.
        connectivity: 4 or 8.
        classes: class ids to polygonize (None: every class).
        scale: what one stored probability unit is worth (1/255 for uint8); None when
            no probabilities are given.
    """

    def __init__(self, width: int, connectivity: int = 4,
                 classes: frozenset[int] | None = None, scale: float | None = None) -> None:
        self.width, self.connectivity, self.classes = width, connectivity, classes
        self.scale = scale
        self._reset()
        self.stats = MergeStats()

    def _reset(self) -> None:
        """Nothing open."""
        self._part_class = np.zeros(0, np.int64)  # [m] open parts ...
        self._part_pixels = np.zeros(0, np.int64)
        self._part_psum: np.ndarray = np.zeros(0, np.float64)
        self._part_region = np.zeros(0, np.int64)  # ... and their open region
        self._piece_geom = np.zeros(0, object)  # [p] polygon pieces of the open parts
        self._piece_part = np.zeros(0, np.int64)  # [p] whose
        self._sealed: dict[int, _Sealed] = {}  # open region -> its complete parts
        self._seams: list[int] = []  # rows between the strips read
        self._seam_labels: np.ndarray | None = None  # [W] last row of the previous strip
        self._seam_keys = np.full(self.width, -1, np.int64)  # [W] open part there, -1: none

    def add(self, labels: np.ndarray, row: int,
            probability: np.ndarray | None = None) -> list[Region]:
        """Take the next strip; return the regions it finished.

        Args:
            labels: ``[h, W]`` uint8 class ids, rows ``row .. row + h``.
            row: the strip's first row in the raster.
            probability: ``[h, W]`` probability of each pixel's own class, in stored
                units (summed exactly, scaled by ``scale`` once per region).
        """
        labels = self._kept(labels)
        comp = _Components(labels, probability, self.connectivity)
        n, m = comp.count, len(self._part_class)
        height, width = labels.shape
        geoms = trace(comp.run_starts, comp.run_part, height, width, n, row)
        # nodes: the open parts, then this strip's components; each joins a part and a region
        part, region = self._join(labels[0], comp.top, m, n, comp.region)
        parts = int(part.max(initial=-1)) + 1
        part_class = np.zeros(parts, np.int64)
        part_class[part] = np.concatenate([self._part_class, comp.classes])
        part_region = np.zeros(parts, np.int64)
        part_region[part] = region
        part_pixels = np.bincount(part, np.concatenate([self._part_pixels, comp.pixels]),
                                  parts).astype(np.int64)  # exact below 2**53
        part_psum = np.bincount(part, np.concatenate([self._part_psum, comp.psum]), parts)
        piece_geom = np.concatenate([self._piece_geom, geoms])
        piece_part = part[np.concatenate([self._piece_part, m + np.arange(n)])]
        last = comp.bottom
        seam_part = part[m + last[last > 0] - 1]
        on_seam = np.zeros(parts, bool)
        on_seam[seam_part] = True
        alive = np.zeros(int(region.max(initial=-1)) + 1, bool)
        alive[part_region[on_seam]] = True
        sealed: dict[int, _Sealed] = {}  # the open regions' complete parts follow merges
        if self._sealed:
            moved = np.zeros(int(self._part_region.max()) + 1, np.int64)
            moved[self._part_region] = region[:m]
            for r, s in self._sealed.items():
                _seal(sealed, int(moved[r]), s)
        done = self._settle(np.flatnonzero(~on_seam), alive, sealed, part_class, part_pixels,
                            part_psum, part_region, piece_geom, piece_part)
        # what stays open: the parts on the seam, renumbered, and their regions
        kept = np.flatnonzero(on_seam)
        index = np.full(parts, -1, np.int64)
        index[kept] = np.arange(kept.size)
        region_index = np.full(alive.size, -1, np.int64)
        region_index[alive] = np.arange(int(alive.sum()))
        self._part_class, self._part_pixels = part_class[kept], part_pixels[kept]
        self._part_psum = part_psum[kept]
        self._part_region = region_index[part_region[kept]]
        held = on_seam[piece_part]
        self._piece_geom, self._piece_part = piece_geom[held], index[piece_part[held]]
        self._sealed = {int(region_index[r]): s for r, s in sealed.items()}
        self._seam_labels = labels[-1].copy()
        self._seams.append(row + labels.shape[0])
        self._seam_keys = np.full(self.width, -1, np.int64)
        self._seam_keys[last > 0] = index[seam_part]
        self._count(done, strip=True)
        return done

    def finish(self) -> list[Region]:
        """The regions still open after the last strip."""
        m = len(self._part_class)
        regions = int(self._part_region.max(initial=-1)) + 1
        done = self._settle(np.arange(m), np.zeros(regions, bool), self._sealed,
                            self._part_class, self._part_pixels, self._part_psum,
                            self._part_region, self._piece_geom, self._piece_part)
        self._reset()
        self._count(done, strip=False)
        return done

    def _settle(self, complete: np.ndarray, alive: np.ndarray, sealed: dict[int, _Sealed],
                part_class: np.ndarray, part_pixels: np.ndarray, part_psum: np.ndarray,
                part_region: np.ndarray, piece_geom: np.ndarray, piece_part: np.ndarray
                ) -> list[Region]:
        """Close the ``complete`` parts (sorted ids); return the regions that finish.

        A complete part's pieces are merged; in a region still alive through another part
        (8-connectivity) it is sealed into ``sealed`` (updated), otherwise it goes out
        with its region and the region's sealed parts.
        """
        geom = _part_geometries(piece_geom, piece_part, complete, part_pixels.size,
                                np.asarray(self._seams, np.float64))
        region = part_region[complete]
        living = alive[region]
        if living.any():  # 8-connectivity: a region lives on through another part
            lp = complete[living]
            order = np.argsort(region[living], kind="stable")
            lr, lg, lp = region[living][order], geom[living][order], lp[order]
            starts = np.flatnonzero(np.r_[True, lr[1:] != lr[:-1]])
            ends = np.r_[starts[1:], lr.size]
            pix = np.add.reduceat(part_pixels[lp], starts)
            ps = np.add.reduceat(part_psum[lp], starts)
            for r, a, b, k, s in zip(lr[starts].tolist(), starts.tolist(), ends.tolist(),
                                     pix.tolist(), ps.tolist()):
                _seal(sealed, r, _Sealed([lg[a:b]], int(k), float(s)))
        out = ~living
        geom, region, parts = geom[out], region[out], complete[out]
        pixels = np.bincount(region, part_pixels[parts], alive.size)
        psum = np.bincount(region, part_psum[parts], alive.size)
        cls = np.zeros(alive.size, np.int64)
        cls[region] = part_class[parts]
        finished = [r for r in sealed if not alive[r]]
        extra = [sealed.pop(r) for r in finished]
        for r, s in zip(finished, extra):
            pixels[r] += s.pixels
            psum[r] += s.probability_sum
        geom = np.concatenate([geom, *(c for s in extra for c in s.chunks)])
        region = np.concatenate([region, *(np.full(len(c), r, np.int64)
                                          for r, s in zip(finished, extra) for c in s.chunks)])
        polygons = geom
        if (shapely.get_type_id(geom) != shapely.GeometryType.POLYGON).any():  # not expected
            polygons, which = shapely.get_parts(geom, return_index=True)
            region = region[which]
        order = np.argsort(region, kind="stable")
        polygons, region = polygons[order], region[order]
        starts = np.flatnonzero(np.r_[True, region[1:] != region[:-1]]) if region.size else \
            np.zeros(0, np.int64)
        counts = np.diff(np.r_[starts, region.size])
        ids = region[starts]
        shapes_ = polygons[starts]
        multi = counts > 1
        if multi.any():
            several = np.repeat(multi, counts)
            shapes_[multi] = shapely.multipolygons(
                polygons[several], indices=np.repeat(np.arange(int(multi.sum())),
                                                      counts[multi]))
        means = (psum[ids] * self.scale / pixels[ids] if self.scale
                 else np.full(ids.size, None, object))
        return [Region(c, g, int(k), p) for c, g, k, p in zip(
            cls[ids].tolist(), shapes_.tolist(), pixels[ids].tolist(), means.tolist())]

    def _count(self, done: list[Region], strip: bool) -> None:
        s = self.stats
        s.strips += strip
        s.regions += len(done)
        open_regions = int(self._part_region.max(initial=-1)) + 1
        s.peak_open_regions = max(s.peak_open_regions, open_regions)
        s.peak_open_pieces = max(s.peak_open_pieces, len(self._piece_geom)
                                 + sum(v.polygons for v in self._sealed.values()))

    def _kept(self, labels: np.ndarray) -> np.ndarray:
        """The labels with the classes not asked for set to no data."""
        if self.classes is None:
            return labels
        return np.where(np.isin(labels, list(self.classes)), labels, NODATA).astype(np.uint8)

    def _join(self, top_labels: np.ndarray, top_comp: np.ndarray, m: int, n: int,
              region_of: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Part and region of each node (open parts 0..m-1, then the strip's components).

        Parts join only across the seam, edge to edge; regions also join diagonally across
        it, and hold the components of one 8-connected component of the strip and the
        open parts of one open region (8-connectivity; with 4 regions are parts).
        """
        pairs = [(slice(None), slice(None))]  # (above, below): same column
        if self.connectivity == 8:  # ... and the two diagonals
            pairs += [(slice(None, -1), slice(1, None)), (slice(1, None), slice(None, -1))]
        src: list[np.ndarray] = []
        dst: list[np.ndarray] = []
        if self._seam_labels is not None and m:
            for above, below in pairs:
                ok = ((self._seam_labels[above] == top_labels[below])
                      & (self._seam_keys[above] >= 0) & (top_comp[below] > 0))
                src.append(self._seam_keys[above][ok])
                dst.append(top_comp[below][ok].astype(np.int64) - 1 + m)
        part = _connected(m + n, src[:1], dst[:1])
        if self.connectivity == 4:
            return part, part
        assert region_of is not None
        for nodes, keys in ((np.arange(m), self._part_region), (m + np.arange(n), region_of)):
            src.append(nodes)
            dst.append(nodes[_first_of_each(keys)])
        return part, _connected(m + n, src, dst)


def _connected(size: int, src: list[np.ndarray], dst: list[np.ndarray]) -> np.ndarray:
    """Connected component (0..k-1) of each of ``size`` nodes joined by edges src-dst."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    a = np.concatenate(src) if src else np.zeros(0, np.int64)
    b = np.concatenate(dst) if dst else np.zeros(0, np.int64)
    if not a.size:
        return np.arange(size)
    graph = coo_matrix((np.ones(a.size, np.int8), (a, b)), shape=(size, size))
    return connected_components(graph, directed=False)[1]


def _first_of_each(keys: np.ndarray) -> np.ndarray:
    """For each position, the first position holding the same key."""
    if not keys.size:
        return np.zeros(0, np.int64)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    return first[inverse]


def _seal(sealed: dict[int, _Sealed], region: int, more: _Sealed) -> None:
    """Add ``more`` to the complete parts of ``region`` (the longer list absorbs)."""
    have = sealed.get(region)
    if have is None:
        sealed[region] = more
        return
    if len(have.chunks) < len(more.chunks):
        have, more = more, have
        sealed[region] = have
    have.absorb(more)


def _part_geometries(piece_geom: np.ndarray, piece_part: np.ndarray, parts: np.ndarray,
                     count: int, seams: np.ndarray) -> np.ndarray:
    """One polygon per part in ``parts`` (sorted ids, each with a piece).

    That is its piece, or the union of its pieces, which meet along the seam lines
    (y in ``seams``): :func:`~seg_at_scale.vectors.stitch.stitch`.
    """
    wanted = np.zeros(count, bool)
    wanted[parts] = True
    sel = wanted[piece_part]
    geom, owner = piece_geom[sel], piece_part[sel]
    order = np.argsort(owner, kind="stable")
    geom, owner = geom[order], owner[order]
    starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]]) if owner.size else \
        np.zeros(0, np.int64)
    ends = np.r_[starts[1:], owner.size]
    out = geom[starts]
    several = np.flatnonzero(ends - starts > 1)
    if several.size:
        sel = _ranges(starts[several], ends[several] - starts[several])
        try:
            out[several] = stitch(geom[sel], np.repeat(np.arange(several.size),
                                                       (ends - starts)[several]), seams)
        except StitchError:  # not expected: the overlay gives the same polygons, slower
            for i in several.tolist():
                out[i] = shapely.union_all(geom[starts[i] : ends[i]])
    return out


def polygonize(labels: Source, *, connectivity: int = 4, classes: Iterable[int] | None = None,
               probabilities: Source | None = None, strip_rows: int | None = None,
               stats: MergeStats | None = None) -> Iterator[Region]:
    """Stream the regions of a label raster, each as soon as it is complete.

    Args:
        labels: ``.zarr`` prediction store, label TIFF, or ``[H, W]`` uint8 array
            (255 = no data, never polygonized).
        connectivity: 4 (edge neighbours) or 8 (edges and corners).
        classes: polygonize only these class ids (None: all).
        probabilities: ``[K, H, W]`` probabilities (store, ``*_probabilities.tif`` or
            array, uint8 = round(255 p) or float) for :attr:`Region.probability`.
        strip_rows: rows per strip (memory); default about 4 Mpx per strip.
        stats: filled with strips read and the peak regions / pieces held open.

    Returns:
        An iterator of :class:`Region` in pixel coordinates, in the order they close.

    Raises:
        InputError: unreadable or mismatched inputs (at once); a class id with no
            probability band (when reached).
        ConfigError: a bad option (at once).
    """
    kept = check_options(connectivity, classes, strip_rows)
    reader = open_labels(labels)
    readers = [reader]
    scale = None
    with closed_on_error(reader):
        if probabilities is not None:
            readers.append(open_probabilities(probabilities, reader))
            scale = probability_scale(readers[1].dtype)
    merger = SeamMerger(reader.width, connectivity, kept, scale)
    if stats is not None:
        merger.stats = stats
    return _stream(merger, readers, strip_rows)  # inputs checked above, before any read


def _stream(merger: SeamMerger, readers: list[BandReader], strip_rows: int | None
            ) -> Iterator[Region]:
    try:
        for row, strips in row_bands(readers, strip_rows):
            lab = strips[0][0]
            own = _own_probability(lab, strips[1], readers[1]) if len(strips) > 1 else None
            yield from merger.add(lab, row, own)
        yield from merger.finish()
    finally:  # read to the end, stopped by an error, or dropped unfinished
        for reader in readers:
            reader.close()


def _own_probability(labels: np.ndarray, probabilities: np.ndarray, reader: BandReader
                     ) -> np.ndarray:
    """``[h, W]`` float64 stored probability of each pixel's own class (0 where no data)."""
    k = probabilities.shape[0]
    valid = labels != NODATA
    if valid.any() and int(labels[valid].max()) >= k:
        raise InputError(f"labels hold class {int(labels[valid].max())} but the probabilities "
                         f"'{reader_path(reader)}' have {k} bands; pass the probabilities of "
                         "the same prediction")
    index = np.where(valid, labels, 0).astype(np.intp)[None]
    return np.take_along_axis(probabilities, index, 0)[0].astype(np.float64)
