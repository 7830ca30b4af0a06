"""Polygons of a label raster without seams, read strip by strip, equal to the whole-image result.

Each strip is polygonized on its own: connected components per class (``scipy.ndimage``),
then GDAL's polygonizer on the component ids (``rasterio.features.shapes``), in pixel
coordinates, which are integers and so exact. A region that crosses a strip's lower seam is
*open*: its pieces wait until the next strip says which of its components continue it
(the two rows either side of the seam, same class, vertically adjacent — or diagonally
too with 8-connectivity). A region none of whose pixels lie on the current lower seam can
grow no more: its pieces are merged with ``shapely.union_all`` and it is yielded at once.
Memory is therefore one strip plus the open regions, not the raster.

The result equals ``rasterio.features.shapes`` on the whole array: one region per
connected region of one class (same count per class), and the same point set, holes
included (``tests/vectors`` prove it on odd sizes with strips of 1 row upwards).
Geometries are made valid: GDAL's self-touching rings become a Polygon whose hole touches
its shell, or, for regions joined only at a corner (8-connectivity), a MultiPolygon.

>>> labels = np.array([[1, 1, 0], [0, 1, 0], [0, 0, 1]], np.uint8)
>>> sorted((r.class_id, r.pixels) for r in polygonize(labels, strip_rows=1))
[(0, 2), (0, 3), (1, 1), (1, 3)]
>>> sorted((r.class_id, r.pixels) for r in polygonize(labels, connectivity=8, strip_rows=1))
[(0, 5), (1, 4)]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import rasterio.features
import shapely
from affine import Affine
from shapely.geometry import shape

from seg_at_scale.errors import ConfigError, InputError
from seg_at_scale.vectors.sources import (
    NODATA,
    BandReader,
    Source,
    open_labels,
    open_probabilities,
    probability_scale,
    reader_path,
    row_bands,
)

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
class _Open:
    """A region still touching the seam below the last strip read."""

    class_id: int
    pieces: list[shapely.Geometry] = field(default_factory=list)
    pixels: int = 0
    probability_sum: float = 0.0


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


class SeamMerger:
    """Turns strips of labels, top to bottom, into finished regions (see module docstring).

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
        from scipy import ndimage  # here: scipy costs 0.3 s of every seg-predict's start

        self._structure = ndimage.generate_binary_structure(2, 1 if connectivity == 4 else 2)
        self._open: list[_Open] = []
        self._seam_labels: np.ndarray | None = None  # [W] last row of the previous strip
        self._seam_keys = np.full(width, -1, np.int64)  # [W] index into _open, -1: none
        self.stats = MergeStats()

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
        comp, comp_class = self._components(labels)
        n, m = len(comp_class), len(self._open)
        flat = comp.ravel()
        pixels = np.bincount(flat, minlength=n + 1)[1:]
        psum = (np.bincount(flat, weights=probability.ravel(), minlength=n + 1)[1:]
                if probability is not None else np.zeros(n))
        pieces = self._pieces(comp, n, row)
        nodes = self._open + [_Open(int(c), p, int(k), float(s))
                              for c, p, k, s in zip(comp_class, pieces, pixels, psum)]
        group = self._join(labels[0], comp[0], m, n)
        last = comp[-1]
        alive = np.unique(group[m + last[last > 0] - 1])
        merged = _merge(nodes, group)
        self._open = [merged[int(g)] for g in alive]
        key = np.full(m + n, -1, np.int64)
        key[alive] = np.arange(alive.size)
        self._seam_labels = labels[-1].copy()
        self._seam_keys = np.full(self.width, -1, np.int64)
        on_seam = last > 0
        self._seam_keys[on_seam] = key[group[m + last[on_seam] - 1]]
        alive_set = set(alive.tolist())
        done = [self._finish(acc) for g, acc in merged.items() if g not in alive_set]
        self._count(done, strip=True)
        return done

    def finish(self) -> list[Region]:
        """The regions still open after the last strip."""
        done, self._open = [self._finish(acc) for acc in self._open], []
        self._count(done, strip=False)
        return done

    def _finish(self, acc: _Open) -> Region:
        geometry = acc.pieces[0] if len(acc.pieces) == 1 else shapely.union_all(acc.pieces)
        mean = acc.probability_sum * self.scale / acc.pixels if self.scale else None
        return Region(acc.class_id, geometry, acc.pixels, mean)

    def _count(self, done: list[Region], strip: bool) -> None:
        s = self.stats
        s.strips += strip
        s.regions += len(done)
        s.peak_open_regions = max(s.peak_open_regions, len(self._open))
        s.peak_open_pieces = max(s.peak_open_pieces, sum(len(o.pieces) for o in self._open))

    def _kept(self, labels: np.ndarray) -> np.ndarray:
        """The labels with the classes not asked for set to no data."""
        if self.classes is None:
            return labels
        return np.where(np.isin(labels, list(self.classes)), labels, NODATA).astype(np.uint8)

    def _components(self, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Component ids ``[h, W]`` int32 (0 = no data), unique over classes, and their class."""
        from scipy import ndimage

        comp = np.zeros(labels.shape, np.int32)
        classes: list[np.ndarray] = []
        n = 0
        present = np.flatnonzero(np.bincount(labels.ravel(), minlength=256)[:NODATA])
        for c in present:
            ids, k = ndimage.label(labels == c, self._structure, output=np.int32)
            np.add(ids, n, out=ids, where=ids > 0)
            comp += ids
            classes.append(np.full(k, c, np.int64))
            n += k
        return comp, np.concatenate(classes) if classes else np.zeros(0, np.int64)

    def _pieces(self, comp: np.ndarray, n: int, row: int) -> list[list[shapely.Geometry]]:
        """Each component's polygon(s) in raster pixel coordinates, made valid."""
        pieces: list[list[shapely.Geometry]] = [[] for _ in range(n)]
        shifted = Affine.translation(0, row)
        for geojson, value in rasterio.features.shapes(comp, mask=comp > 0, transform=shifted,
                                                       connectivity=self.connectivity):
            polygon = shape(geojson)
            if not polygon.is_valid:  # GDAL's rings touch themselves where holes pinch
                polygon = shapely.make_valid(polygon)
            pieces[int(value) - 1].append(polygon)
        return pieces

    def _join(self, top_labels: np.ndarray, top_comp: np.ndarray, m: int, n: int
              ) -> np.ndarray:
        """Group of each node (open regions 0..m-1, then the strip's components)."""
        src: list[np.ndarray] = []
        dst: list[np.ndarray] = []
        if self._seam_labels is not None and m:
            pairs = [(slice(None), slice(None))]  # (above, below): same column
            if self.connectivity == 8:  # ... and the two diagonals
                pairs += [(slice(None, -1), slice(1, None)), (slice(1, None), slice(None, -1))]
            for above, below in pairs:
                ok = ((self._seam_labels[above] == top_labels[below])
                      & (self._seam_keys[above] >= 0) & (top_comp[below] > 0))
                src.append(self._seam_keys[above][ok])
                dst.append(top_comp[below][ok].astype(np.int64) - 1 + m)
        a = np.concatenate(src) if src else np.zeros(0, np.int64)
        b = np.concatenate(dst) if dst else np.zeros(0, np.int64)
        from scipy.sparse import coo_matrix
        from scipy.sparse.csgraph import connected_components

        graph = coo_matrix((np.ones(a.size, np.int8), (a, b)), shape=(m + n, m + n))
        return connected_components(graph, directed=False)[1]


def _merge(nodes: list[_Open], group: np.ndarray) -> dict[int, _Open]:
    """One accumulator per group: pieces, pixels and probability sums added up."""
    merged: dict[int, _Open] = {}
    for node, g in zip(nodes, group.tolist()):
        acc = merged.get(g)
        if acc is None:
            merged[g] = node
        else:
            acc.pieces.extend(node.pieces)
            acc.pixels += node.pixels
            acc.probability_sum += node.probability_sum
    return merged


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
    if probabilities is not None:
        readers.append(open_probabilities(probabilities, reader))
        scale = probability_scale(readers[1].dtype)
    merger = SeamMerger(reader.width, connectivity, kept, scale)
    if stats is not None:
        merger.stats = stats
    return _stream(merger, readers, strip_rows)  # inputs checked above, before any read


def _stream(merger: SeamMerger, readers: list[BandReader], strip_rows: int | None
            ) -> Iterator[Region]:
    for row, strips in row_bands(readers, strip_rows):
        lab = strips[0][0]
        own = _own_probability(lab, strips[1], readers[1]) if len(strips) > 1 else None
        yield from merger.add(lab, row, own)
    yield from merger.finish()


def _own_probability(labels: np.ndarray, probabilities: np.ndarray, reader: object
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
