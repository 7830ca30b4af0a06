"""Windowed reading of rasters far larger than memory: (Big/Geo)TIFF, and what GDAL opens.

:class:`RasterReader` decodes only the tiles or strips a window touches: it reads their
bytes with one seek + read each and hands them to ``tifffile``'s per-page segment decoder,
so every compression, predictor and layout ``tifffile`` understands works, and nothing
else is read. (We do not go through the zarr store: zarr 3 runs an asyncio thread, which
does not survive ``os.fork`` in data-loader workers.) Uncompressed striped files are
memory-mapped instead, so a window of a single-strip file reads its own rows only; a
compressed file whose segments are far larger than the windows read from it is decoded
whole, segment by segment, again and again: it gets one warning saying how to convert it.

GDAL's internal mask (the per-dataset mask IFD of COGs and JPEG files) is read like the
image: :meth:`RasterReader.read_mask`.

Any other raster GDAL opens (a VRT mosaic of many files, JPEG 2000, ERDAS Imagine, ...) is
read through rasterio by :class:`GdalReader`, which ``RasterReader(path)`` returns for a
file whose first bytes are not a TIFF header: the same windows, fills, mask and no-data
rules, with the georeferencing carried to the outputs as GeoTIFF tags
(:meth:`~seg_at_scale.io.geotags.GeoTags.from_gdal`).

>>> with RasterReader("scene.tif") as r:  # doctest: +SKIP
...     patch = r.read(Window(-92, -92, 572, 572), fill="reflect")  # [C, 572, 572]

The writers live in :mod:`seg_at_scale.io.writer` and are re-exported here.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast

import numpy as np
import tifffile

from seg_at_scale.errors import InputError
from seg_at_scale.io.geotags import GDAL_NODATA_TAG, GeoTags, open_dataset
from seg_at_scale.io.segments import PageLayout, SegmentCache, image_pages, mask_page
from seg_at_scale.io.threads import pixel_threads
from seg_at_scale.io.writer import check_output_path, write_raster, write_raster_bands
from seg_at_scale.tiling.geometry import Fill, Window, source_indices

__all__ = [
    "GdalReader",
    "RasterReader",
    "is_tiff",
    "raster_files",
    "read_raster",
    "write_raster",
    "write_raster_bands",
    "check_output_path",
]


log = logging.getLogger(__name__)
_Reader = TypeVar("_Reader", bound="RasterReader")

# A compressed read that decodes this many times the window's pixels (and at least
# WASTE_MIN_PIXELS) means the file's segments are far larger than the windows read.
WASTE_RATIO, WASTE_MIN_PIXELS = 16, 1 << 22
_warned: set[Path] = set()  # files warned about (once per process)


def _open_binary(path: Path) -> BinaryIO:
    """Open ``path`` for binary reading (a seam: tests substitute a byte-counting file)."""
    return open(path, "rb")  # noqa: SIM115 - owned and closed by RasterReader


#: The first four bytes of a TIFF (II / MM byte order; 42 classic, 43 BigTIFF).
TIFF_MAGIC = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")


def is_tiff(path: str | os.PathLike[str]) -> bool:
    """True unless ``path`` is a readable file that does not start like a TIFF.

    A missing, unreadable or nearly empty file counts as a TIFF, so that the TIFF reader
    names the problem.
    """
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
    except OSError:
        return True
    return len(head) < 4 or head in TIFF_MAGIC


def _cannot_read(path: Path, reason: object) -> InputError:
    return InputError(f"cannot read '{path}' as TIFF: {reason}. "
                      "Check the path, or re-create / re-copy the file.")


class RasterReader:
    """Windowed reader of a TIFF / BigTIFF / GeoTIFF (page 0 only, plus GDAL's mask).

    Tiled or striped, any compression ``tifffile`` decodes, 1..N bands interleaved (YXS)
    or planar (SYX), any dtype. A window is decoded from the segments it touches only, or
    indexed from a memory map for uncompressed striped files.

    Picklable and fork-safe: pickling keeps only ``path`` and ``nodata``; the file is
    reopened in the new process, and also after ``os.fork`` (the pid is checked on read).
    Reads from threads sharing one reader are serialised around the file access.

    Attributes:
        path: the file.
        height: image rows.
        width: image columns.
        bands: samples per pixel (channels).
        dtype: sample dtype as stored.
        nodata: the ``nodata`` argument, else the GDAL_NODATA tag, else None.
        geotags: GeoTIFF tags of page 0 (empty if it has none).
        has_mask: the file has a GDAL internal mask (:meth:`read_mask`).
        layout: where page 0's pixels are (segment shape, compression, memory-mappable).
        bytes_read: bytes of tile / strip data read (or copied from the map) so far.
        segments: the decoded segments kept for overlapping windows (image, mask), see
            :class:`~seg_at_scale.io.segments.SegmentCache`.

    """

    path: Path
    height: int
    width: int
    bands: int
    dtype: np.dtype
    nodata: float | None
    geotags: GeoTags
    has_mask: bool
    layout: PageLayout
    bytes_read: int
    segments: dict[bool, SegmentCache]

    def __new__(cls: type[_Reader], path: str | os.PathLike[str] | None = None, *args: Any,
                **kwargs: Any) -> _Reader:
        """A :class:`GdalReader` for a file that is not a TIFF (``path=None``: unpickling)."""
        if cls is RasterReader and path is not None and not is_tiff(path):
            return cast(_Reader, object.__new__(GdalReader))
        return object.__new__(cls)

    def __init__(self, path: str | os.PathLike[str], *, nodata: float | None = None) -> None:
        self.path = Path(path)
        self._nodata_arg = nodata
        self._fh: BinaryIO | None = None
        self._tif: tifffile.TiffFile | None = None
        self._maps: dict[bool, np.memmap] = {}  # image / mask, mapped lazily
        self._pid = -1
        self._lock = threading.Lock()
        self.bytes_read = 0
        try:
            self._setup()
        except BaseException:
            self._close_handles()
            raise

    def _setup(self) -> None:
        """Open the file and set the public attributes (:class:`GdalReader`: through GDAL)."""
        self._describe(self._open())

    def _describe(self, page: tifffile.TiffPage) -> None:
        """Set the public attributes from page 0 and refuse layouts we cannot read."""
        self.height, self.width = int(page.imagelength), int(page.imagewidth)
        self.bands = int(page.samplesperpixel)
        if page.dtype is None:
            raise _cannot_read(self.path, f"unsupported sample format ({page.bitspersample}-bit,"
                                          f" SampleFormat {page.sampleformat})")
        self.dtype = np.dtype(page.dtype)
        self.geotags = GeoTags.from_page(page)
        nodata = self._nodata_arg
        self.nodata = nodata if nodata is not None else self._nodata_tag(page)
        self.has_mask = self._mask is not None
        self._check_layout(page)

    # -- opening -----------------------------------------------------------------------

    def _open(self) -> tifffile.TiffPage:
        """(Re)open the file in this process and return page 0."""
        self._close_handles()
        try:
            self._fh = _open_binary(self.path)
            self._tif = tifffile.TiffFile(self._fh)
            page = self._tif.pages.first
            if not isinstance(page, tifffile.TiffPage):
                raise ValueError("page 0 is not an image page")
            # cache what reading needs, so no tifffile call touches the file after this
            self.layout = PageLayout.of(page, self._tif.byteorder)
            self._decode, self._jpegtables = page.decode, page.jpegtables
            mask = mask_page(self._tif, self.layout.height, self.layout.width)
            self._mask = None if mask is None else (PageLayout.of(mask, self._tif.byteorder),
                                                   mask.decode, mask.jpegtables)
        except (OSError, ValueError, tifffile.TiffFileError, IndexError, KeyError) as exc:
            self._close_handles()
            raise _cannot_read(self.path, exc) from exc
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.segments = {False: SegmentCache(), True: SegmentCache()}  # image / mask
        return page

    def _nodata_tag(self, page: tifffile.TiffPage) -> float | None:
        tag = page.tags.get(GDAL_NODATA_TAG)
        if tag is None:
            return None
        text = str(tag.value).strip().strip("\x00")
        try:
            return float(text)
        except ValueError as exc:
            raise InputError(f"'{self.path}' has an unreadable GDAL_NODATA tag {text!r}; "
                             "pass nodata=<value> explicitly") from exc

    def _check_layout(self, page: tifffile.TiffPage) -> None:
        """Refuse volumes and truncated files up front, with a clear message."""
        if int(page.imagedepth) != 1:
            raise _cannot_read(self.path, f"it is a 3-D volume (depth {page.imagedepth})")
        images = image_pages(self._tif) if self._tif is not None else 1
        if images > 1:
            raise InputError(
                f"'{self.path}' holds {images} images (pages) and is read as one: give each "
                f"alone (gdal_translate GTIFF_DIR:2:{self.path} page2.tif, and so on), or "
                "stack them as bands (gdalbuildvrt -separate) if they are one scene's bands")
        layouts = [self.layout] + ([self._mask[0]] if self._mask else [])
        ends = [o + n for lay in layouts
                for o, n in zip(lay.offsets, lay.counts, strict=True) if o and n]
        size = self.path.stat().st_size
        if ends and max(ends) > size:
            raise InputError(f"'{self.path}' is truncated: its data ends at byte {max(ends)} "
                             f"but the file has {size} bytes. Re-copy or re-generate it.")

    def _ensure_open(self) -> None:
        """Make sure the handle belongs to this process (reopen after fork or close)."""
        if self._tif is None or self._pid != os.getpid():
            # after a fork the handles share the parent's file offset: drop, never seek them
            self._fh = self._tif = None
            self._maps = {}
            self._open()

    def _close_handles(self) -> None:
        if self._tif is not None:
            self._tif.close()
        if self._fh is not None:
            self._fh.close()
        self._tif = self._fh = None
        self._maps = {}

    def close(self) -> None:
        """Close the file (it is reopened if the reader is used again)."""
        if self._pid == os.getpid():
            self._close_handles()
        # new caches rather than clearing the old: after a fork, another thread of the
        # parent may have held a cache's lock at the fork, forever locked in this process
        self.segments = {False: SegmentCache(), True: SegmentCache()}
        self._tif = self._fh = None
        self._maps = {}

    def __enter__(self: _Reader) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "nodata": self._nodata_arg}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], nodata=state["nodata"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return (f"RasterReader('{self.path}', bands={self.bands}, height={self.height}, "
                f"width={self.width}, dtype={self.dtype}, nodata={self.nodata})")

    # -- properties --------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(bands, height, width)``."""
        return (self.bands, self.height, self.width)

    @property
    def is_float(self) -> bool:
        """True for floating-point samples (which may hold NaN)."""
        return bool(np.issubdtype(self.dtype, np.floating))

    # -- reading -----------------------------------------------------------------------

    def read(self, window: Window, *, fill: Fill | None = None,
             pixels: bool = False) -> np.ndarray:
        """Read a window of all bands.

        Args:
            window: rows/cols in image coordinates; may reach outside the image only
                with ``fill``.
            fill: ``"reflect"`` (``numpy.pad`` reflect, repeated as often as needed) or
                ``"constant"`` (zeros) for the pixels outside the image.
            pixels: for a pixel-interleaved file, return a view of ``[h, w, C]`` memory
                (the file's own order, for a channels-last consumer) instead of band
                after band (:meth:`~seg_at_scale.io.segments.PageLayout.empty_box`).

        Returns:
            ``[C, window.height, window.width]`` in the file's dtype.

        Raises:
            InputError: the window is empty, or outside the image without ``fill``, or a
                segment cannot be decoded.

        """
        return self._read_window(window, fill, mask=False, pixels=pixels)

    def read_mask(self, window: Window, *, fill: Fill | None = None) -> np.ndarray | None:
        """GDAL's internal mask over a window: ``[h, w]`` bool, False where no-data.

        Pixels where the mask is 0 are no-data, like pixels equal to :attr:`nodata`.
        Outside the image ``fill="reflect"`` mirrors the mask like the image, and
        ``"constant"`` (zero padding, not no-data) gives True.

        Returns:
            The mask, or None when the file has none (:attr:`has_mask`).
        """
        if self._mask is None:
            return None
        return self._read_window(window, fill, mask=True)[0] != 0

    def _read_window(self, window: Window, fill: Fill | None, mask: bool,
                     pixels: bool = False) -> np.ndarray:
        if window.height < 1 or window.width < 1:
            raise InputError(f"cannot read {window} from '{self.path}': the window is empty")
        inside = (window.row >= 0 and window.col >= 0 and window.row_end <= self.height
                  and window.col_end <= self.width)
        if inside:
            return self._read_box(window.row, window.row_end, window.col, window.col_end, mask,
                                  pixels)
        if fill not in ("reflect", "constant"):
            raise InputError(
                f"{window} reaches outside '{self.path}' ({self.height}x{self.width} pixels); "
                "read inside the image or pass fill='reflect' or fill='constant'")
        rows = source_indices(window.row, window.height, self.height, fill)
        cols = source_indices(window.col, window.width, self.width, fill)
        out = (np.ones((1, window.height, window.width), np.uint8) if mask
               else self.layout.empty_box(window.height, window.width, 0, pixels))
        # the window's part inside the image, in the window's own pixels
        a, b = max(0, window.row), min(self.height, window.row_end)
        c, d = max(0, window.col), min(self.width, window.col_end)
        if a < b and c < d and (fill == "constant" or (
                rows.min() >= a and rows.max() < b and cols.min() >= c and cols.max() < d)):
            # decoded into place; a reflection copies its margins from that part (every
            # source pixel lies in it): no pass over the whole window but the decoding
            rr, cc = slice(a - window.row, b - window.row), slice(c - window.col, d - window.col)
            part = out[:, rr, cc]
            if mask:
                part[...] = 0  # what a mask segment never written reads as
            self._read_box(a, b, c, d, mask, pixels, out=part)
            if fill == "reflect":
                edge = np.r_[0 : rr.start, rr.stop : window.height]
                out[:, edge, cc] = out[:, rows[edge] - window.row, cc]
                edge = np.r_[0 : cc.start, cc.stop : window.width]
                out[:, :, edge] = out[:, :, cols[edge] - window.col]
            return out
        vr, vc = np.flatnonzero(rows >= 0), np.flatnonzero(cols >= 0)
        if vr.size == 0 or vc.size == 0:
            return out  # entirely outside, constant fill
        r0, r1 = int(rows[vr].min()), int(rows[vr].max()) + 1
        c0, c1 = int(cols[vc].min()), int(cols[vc].max()) + 1
        box = _take(_take(self._read_box(r0, r1, c0, c1, mask, pixels), rows[vr] - r0, 1),
                    cols[vc] - c0, 2)
        # a reflection reaching past the window's inside part (or a window wholly outside):
        # the pixels inside are one block of the window, the whole window
        out[:, vr[0] : vr[-1] + 1, vc[0] : vc[-1] + 1] = box
        return out

    def _read_box(self, r0: int, r1: int, c0: int, c1: int, mask: bool = False,
                  pixels: bool = False, out: np.ndarray | None = None) -> np.ndarray:
        """``[C, r1-r0, c1-c0]`` for a box inside the image (``mask``: the mask's box).

        ``out``: fill this array (a view of a window, zeros) instead of a new one.
        """
        self._ensure_open()
        if mask:
            assert self._mask is not None
            layout, decode, tables = self._mask
        else:
            layout, decode, tables = self.layout, self._decode, self._jpegtables
        try:
            if layout.contiguous is not None:
                if mask not in self._maps:
                    self._maps[mask] = layout.memmap(self.path)
                box = layout.map_box(self._maps[mask], r0, r1, c0, c1, pixels)
                with self._lock:
                    self.bytes_read += box.nbytes
                if out is None:
                    return box
                out[...] = box
                return out
            cache = self.segments[mask] if layout.compressed else None
            self._warn_if_wasteful(layout, r0, r1, c0, c1, cache)
            return layout.decode_box(self._read_bytes, decode, tables, r0, r1, c0, c1,
                                     pool=pixel_threads(), cache=cache, pixels=pixels, out=out)
        except (ValueError, RuntimeError, OSError, tifffile.TiffFileError) as exc:
            raise InputError(f"cannot decode rows {r0}:{r1}, cols {c0}:{c1} of '{self.path}': "
                             f"{exc}. Re-copy or re-generate the file.") from exc

    def _warn_if_wasteful(self, layout: PageLayout, r0: int, r1: int, c0: int, c1: int,
                          cache: SegmentCache | None) -> None:
        """One warning per file when every window decodes far more pixels than it holds.

        Segments that fit the reader's cache are decoded once for the windows after.
        """
        decoded = layout.decoded_pixels(r0, r1, c0, c1)
        if (self.path in _warned or cache is None or decoded < WASTE_MIN_PIXELS
                or decoded < WASTE_RATIO * (r1 - r0) * (c1 - c0)
                or decoded * layout.bands * layout.dtype.itemsize <= cache.max_bytes):
            return
        _warned.add(self.path)
        kind = "tiles" if layout.tiled else "strips"
        log.warning(
            "'%s' stores %s %s of %dx%d pixels: reading a %dx%d window decodes %.0fx its "
            "pixels, for every window. Convert it once to a tiled file, e.g. `gdal_translate "
            "-co TILED=YES -co BLOCKXSIZE=512 -co BLOCKYSIZE=512 -co COMPRESS=DEFLATE in.tif "
            "out.tif` (or store it uncompressed: striped raw files are memory-mapped)",
            self.path, layout.compression.lower(), kind, *layout.seg, r1 - r0, c1 - c0,
            decoded / ((r1 - r0) * (c1 - c0)))

    def _read_bytes(self, offset: int, count: int) -> bytes | None:
        if not offset or not count:
            return None  # a sparse (never written) segment reads as zeros
        assert self._fh is not None
        with self._lock:
            self._fh.seek(offset)
            data = self._fh.read(count)
            self.bytes_read += len(data)
        if len(data) != count:
            raise OSError(f"short read at byte {offset}: {len(data)} of {count} bytes")
        return data


#: Handles a forked child inherited from its parent: kept, never closed in the child (closing
#: could wait on a lock a parent thread held at the fork).
_INHERITED: list[Any] = []


class GdalReader(RasterReader):
    """A raster GDAL opens that is not a TIFF (a VRT mosaic, JPEG 2000, ...), via rasterio.

    ``RasterReader(path)`` returns one for such a file; its windows, fills, mask and
    no-data rules are :class:`RasterReader`'s. The no-data value is the ``nodata`` argument,
    else the bands' own (one value for every band). GDAL's per-dataset mask (not an alpha
    band, which is read as a band) is :meth:`read_mask`'s. Every file the raster is made
    of (:attr:`files`: a VRT's sources too) must exist when it is opened, so that a missing
    source is named before any work rather than when a window first needs it. Reads share
    one dataset per process, serialised (GDAL decodes with its own block cache).

    Attributes:
        files: the files GDAL reads this raster from, the named file first.
    """

    files: list[Path]

    def __init__(self, path: str | os.PathLike[str], *, nodata: float | None = None) -> None:
        self._ds: Any = None
        self._mask = None
        super().__init__(path, nodata=nodata)

    def _setup(self) -> None:
        self._describe_dataset(self._open_dataset())

    def _open_dataset(self) -> Any:
        from rasterio.errors import RasterioIOError

        self._close_handles()
        try:
            self._ds = open_dataset(self.path)
        except RasterioIOError as exc:
            said = str(exc).rstrip(".")
            raise InputError(f"cannot read '{self.path}' as a raster: it is not a TIFF, and "
                             f"GDAL says: {said}. Check the path, or re-create / re-copy the "
                             "file.") from exc
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.segments = {False: SegmentCache(), True: SegmentCache()}
        return self._ds

    def _describe_dataset(self, ds: Any) -> None:
        from rasterio.enums import MaskFlags

        self.height, self.width, self.bands = int(ds.height), int(ds.width), int(ds.count)
        if self.bands < 1 and ds.subdatasets:  # HDF5, NetCDF: a container of rasters
            shown = ", ".join(ds.subdatasets[:3]) + (", ..." if len(ds.subdatasets) > 3 else "")
            raise InputError(f"'{self.path}' holds {len(ds.subdatasets)} rasters (GDAL "
                             f"subdatasets: {shown}), not one; write the one to predict as "
                             f"a GeoTIFF, e.g. `gdal_translate '{ds.subdatasets[0]}' "
                             f"{self.path.stem}.tif`")
        if self.bands < 1:
            raise InputError(f"cannot read '{self.path}' as a raster: it has no bands")
        if len(set(ds.dtypes)) != 1:
            raise InputError(f"'{self.path}' has bands of different sample types "
                             f"({', '.join(ds.dtypes)}); make them one, e.g. `gdal_translate "
                             f"-ot {ds.dtypes[0].capitalize()} in out.tif`")
        self.dtype = np.dtype(ds.dtypes[0])
        self.files = [Path(f) for f in ds.files] or [self.path]
        missing = [f for f in self.files[1:] if not f.exists()]
        if missing:
            raise InputError(f"'{self.path}' reads '{missing[0]}', which does not exist "
                             f"({len(missing)} of its {len(self.files) - 1} files missing); "
                             "restore them or rebuild it (e.g. gdalbuildvrt)")
        self.geotags = GeoTags.from_gdal(ds)
        self._band_values = tuple(ds.nodatavals)
        flags = set(ds.mask_flag_enums[0])
        self.has_mask = (MaskFlags.per_dataset in flags
                         and not flags & {MaskFlags.nodata, MaskFlags.alpha, MaskFlags.all_valid})
        seg = tuple(int(n) for n in ds.block_shapes[0])
        self.layout = PageLayout(self.height, self.width, self.bands, self.dtype, True,
                                 (seg[0], seg[1]), True, f"GDAL {ds.driver}", (), (), None)
        if self.has_mask:
            self._mask = (self.layout, None, None)  # type: ignore[assignment]
        if (ds.driver == "VRT" and not self.has_mask and self._nodata_arg is None
                and all(v is None for v in self._band_values)):
            self._refuse_masked_sources()

    def _refuse_masked_sources(self) -> None:
        """Refuse a VRT whose pieces GDAL composites through their masks, unmarked.

        Where such a piece's mask (its alpha band, no-data value or mask) is 0, GDAL gives 0
        in every band of the VRT, which marks those pixels neither masked nor no data: the
        model would read GDAL's zeros as data, and label them unlike the pieces themselves.
        """
        from rasterio.enums import ColorInterp, MaskFlags

        from seg_at_scale.io.vrt import masked_sources

        for file, band in masked_sources(self.path):
            if not file.exists():
                continue  # named by the missing-files check
            with open_dataset(file) as src:
                if band > src.count:
                    continue
                flags = set(src.mask_flag_enums[band - 1])
                alpha = [k + 1 for k, c in enumerate(src.colorinterp) if c == ColorInterp.alpha]
                value = src.nodata
            if MaskFlags.all_valid in flags:
                continue
            raw = f"delete those lines (`sed -i '/<UseMaskBand>/d' {self.path}`)"
            if MaskFlags.alpha in flags and alpha:
                what, fix = f"its band {alpha[0]}, tagged alpha", (
                    f"If that band is data a writer tagged alpha (4-band images often are), "
                    f"{raw}, or re-tag the pieces (`gdal_edit.py -colorinterp_{alpha[0]} "
                    "undefined`) and rebuild the VRT; if those pixels are no data, pass nodata=0"
                    " or rebuild it with `gdalbuildvrt -vrtnodata 0`")
            else:
                shown = "0" if value is None else f"{value:g}"
                what = "its no-data value" if MaskFlags.nodata in flags else "its mask"
                fix = (f"If those pixels are no data, pass nodata=0 or rebuild it with "
                       f"`gdalbuildvrt -vrtnodata {shown}`; to read the pieces' own samples "
                       f"there, {raw}")
            raise InputError(
                f"'{self.path}' reads band {band} of '{file}' through {what} "
                "(<UseMaskBand>true</UseMaskBand>): GDAL gives 0 where that hides a pixel, and "
                "the VRT marks such pixels neither no data nor masked, so the model would read "
                f"GDAL's zeros as data. {fix}")

    @property
    def nodata(self) -> float | None:  # type: ignore[override]
        """The ``nodata`` argument, else the bands' one value.

        Bands with different values are refused where the value is asked for, not when the
        file is opened: opening it for its size or its files needs none, and ``nodata=``
        decides it for the prediction.
        """
        if self._nodata_arg is not None:
            return self._nodata_arg
        return self._band_nodata(self._band_values)

    def __repr__(self) -> str:
        return (f"RasterReader('{self.path}', bands={self.bands}, height={self.height}, "
                f"width={self.width}, dtype={self.dtype}, nodata={self._nodata_arg}, "
                f"band nodata={self._band_values})")

    def _band_nodata(self, values: tuple[float | None, ...]) -> float | None:
        distinct = {"nan" if v is not None and np.isnan(v) else v for v in values}
        if len(distinct) > 1:
            shown = ", ".join("none" if v is None else str(v) for v in values)
            raise InputError(f"'{self.path}' has a different no-data value per band ({shown});"
                             " pass nodata=<value> for all of them")
        value = values[0]
        return None if value is None else float(value)

    def _ensure_open(self) -> None:
        if self._ds is None or self._pid != os.getpid():
            if self._ds is not None:
                _INHERITED.append(self._ds)
                self._ds = None
            self._open_dataset()

    def _close_handles(self) -> None:
        if self._ds is not None and self._pid == os.getpid():
            self._ds.close()
        self._ds = None

    def _read_box(self, r0: int, r1: int, c0: int, c1: int, mask: bool = False,
                  pixels: bool = False, out: np.ndarray | None = None) -> np.ndarray:
        """``[C, r1-r0, c1-c0]`` (``mask``: ``[1, ...]``, 0 = no data) for a box inside.

        ``out``: fill this array (a view of a window) instead of a new one.
        """
        from rasterio.errors import RasterioIOError
        from rasterio.windows import Window as GdalWindow

        self._ensure_open()
        window = GdalWindow(c0, r0, c1 - c0, r1 - r0)
        try:
            with self._lock:
                box = (self._ds.dataset_mask(window=window)[None] if mask
                       else self._ds.read(window=window))
                self.bytes_read += box.nbytes
        except RasterioIOError as exc:
            said = str(exc.__cause__ or exc).rstrip(".")  # GDAL's own words, where chained
            raise InputError(f"cannot read rows {r0}:{r1}, cols {c0}:{c1} of '{self.path}': "
                             f"{said}. Re-copy or re-generate the file (and its sources)."
                             ) from exc
        if out is None:
            return np.asarray(box)
        out[...] = box
        return out


def raster_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files a raster is read from: a TIFF itself, else GDAL's list (a VRT's sources)."""
    if is_tiff(path):
        return [Path(path)]
    with GdalReader(path) as reader:
        return reader.files


def _take(a: np.ndarray, index: np.ndarray, axis: int) -> np.ndarray:
    """``a.take(index, axis)``, a view when ``index`` is one increasing run (no copy)."""
    if index.size and index[-1] - index[0] == index.size - 1 and (np.diff(index) == 1).all():
        return a[(slice(None),) * axis + (slice(int(index[0]), int(index[-1]) + 1),)]
    return a.take(index, axis=axis)


def read_raster(path: str | os.PathLike[str], *, nodata: float | None = None) -> np.ndarray:
    """Read a whole (small) raster as ``[C, H, W]``: for tests and small images only."""
    with RasterReader(path, nodata=nodata) as reader:
        return reader.read(Window(0, 0, reader.height, reader.width))
