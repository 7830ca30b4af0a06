"""Windowed reading of (Big/Geo)TIFF rasters far larger than memory.

:class:`RasterReader` decodes only the tiles or strips a window touches: it reads their
bytes with one seek + read each and hands them to ``tifffile``'s per-page segment decoder,
so every compression, predictor and layout ``tifffile`` understands works, and nothing
else is read. (We do not go through the zarr store: zarr 3 runs an asyncio thread, which
does not survive ``os.fork`` in data-loader workers.)

>>> with RasterReader("scene.tif") as r:  # doctest: +SKIP
...     patch = r.read(Window(-92, -92, 572, 572), fill="reflect")  # [C, 572, 572]

The writers live in :mod:`seg_at_scale.io.writer` and are re-exported here.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import tifffile

from seg_at_scale.errors import InputError
from seg_at_scale.io.geotags import GDAL_NODATA_TAG, GeoTags
from seg_at_scale.io.writer import check_output_path, write_raster, write_raster_bands
from seg_at_scale.tiling.geometry import Fill, Window, source_indices

__all__ = [
    "RasterReader",
    "read_raster",
    "write_raster",
    "write_raster_bands",
    "check_output_path",
]



def _open_binary(path: Path) -> BinaryIO:
    """Open ``path`` for binary reading (a seam: tests substitute a byte-counting file)."""
    return open(path, "rb")  # noqa: SIM115 - owned and closed by RasterReader


def _cannot_read(path: Path, reason: object) -> InputError:
    return InputError(f"cannot read '{path}' as TIFF: {reason}. "
                      "Check the path, or re-create / re-copy the file.")


class RasterReader:
    """Windowed reader of a TIFF / BigTIFF / GeoTIFF (page 0 only).

    Tiled or striped, any compression ``tifffile`` decodes, 1..N bands interleaved (YXS)
    or planar (SYX), any dtype. A window is decoded from the segments it touches only.

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
        bytes_read: bytes of tile / strip data read so far (for I/O accounting).

    """

    path: Path
    height: int
    width: int
    bands: int
    dtype: np.dtype
    nodata: float | None
    geotags: GeoTags
    bytes_read: int

    def __init__(self, path: str | os.PathLike[str], *, nodata: float | None = None) -> None:
        self.path = Path(path)
        self._nodata_arg = nodata
        self._fh: BinaryIO | None = None
        self._tif: tifffile.TiffFile | None = None
        self._pid = -1
        self._lock = threading.Lock()
        self.bytes_read = 0
        page = self._open()
        try:
            self._describe(page)
        except BaseException:
            self._close_handles()
            raise

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
        self._planar = self.bands > 1 and int(page.planarconfig) == 2
        if page.is_tiled:
            self._seg = (int(page.tilelength), int(page.tilewidth))
        else:
            self._seg = (min(int(page.rowsperstrip) or self.height, self.height), self.width)
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
        except (OSError, ValueError, tifffile.TiffFileError, IndexError, KeyError) as exc:
            self._close_handles()
            raise _cannot_read(self.path, exc) from exc
        # cache what reading needs, so no tifffile call touches the file after this
        self._offsets = tuple(int(o) for o in page.dataoffsets)
        self._counts = tuple(int(n) for n in page.databytecounts)
        self._decode = page.decode
        self._jpegtables = page.jpegtables
        self._pid = os.getpid()
        self._lock = threading.Lock()
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
        ends = [o + n for o, n in zip(self._offsets, self._counts, strict=True) if o and n]
        size = self.path.stat().st_size
        if ends and max(ends) > size:
            raise InputError(f"'{self.path}' is truncated: its data ends at byte {max(ends)} "
                             f"but the file has {size} bytes. Re-copy or re-generate it.")

    def _ensure_open(self) -> None:
        """Make sure the handle belongs to this process (reopen after fork or close)."""
        if self._tif is None or self._pid != os.getpid():
            # after a fork the handles share the parent's file offset: drop, never seek them
            self._fh = self._tif = None
            self._open()

    def _close_handles(self) -> None:
        if self._tif is not None:
            self._tif.close()
        if self._fh is not None:
            self._fh.close()
        self._tif = self._fh = None

    def close(self) -> None:
        """Close the file (it is reopened if the reader is used again)."""
        if self._pid == os.getpid():
            self._close_handles()
        self._tif = self._fh = None

    def __enter__(self) -> RasterReader:
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

    def read(self, window: Window, *, fill: Fill | None = None) -> np.ndarray:
        """Read a window of all bands.

        Args:
            window: rows/cols in image coordinates; may reach outside the image only
                with ``fill``.
            fill: ``"reflect"`` (``numpy.pad`` reflect, repeated as often as needed) or
                ``"constant"`` (zeros) for the pixels outside the image.

        Returns:
            ``[C, window.height, window.width]`` in the file's dtype.

        Raises:
            InputError: the window is empty, or outside the image without ``fill``, or a
                segment cannot be decoded.

        """
        if window.height < 1 or window.width < 1:
            raise InputError(f"cannot read {window} from '{self.path}': the window is empty")
        inside = (window.row >= 0 and window.col >= 0 and window.row_end <= self.height
                  and window.col_end <= self.width)
        if inside:
            return self._read_box(window.row, window.row_end, window.col, window.col_end)
        if fill not in ("reflect", "constant"):
            raise InputError(
                f"{window} reaches outside '{self.path}' ({self.height}x{self.width} pixels); "
                "read inside the image or pass fill='reflect' or fill='constant'")
        rows = source_indices(window.row, window.height, self.height, fill)
        cols = source_indices(window.col, window.width, self.width, fill)
        out = np.zeros((self.bands, window.height, window.width), self.dtype)
        vr, vc = np.flatnonzero(rows >= 0), np.flatnonzero(cols >= 0)
        if vr.size == 0 or vc.size == 0:
            return out  # entirely outside, constant fill
        r0, r1 = int(rows[vr].min()), int(rows[vr].max()) + 1
        c0, c1 = int(cols[vc].min()), int(cols[vc].max()) + 1
        box = self._read_box(r0, r1, c0, c1)
        out[:, vr[:, None], vc[None, :]] = box[:, (rows[vr] - r0)[:, None], (cols[vc] - c0)[None]]
        return out

    def _segments(self, r0: int, r1: int, c0: int, c1: int) -> list[int]:
        """List the indices (into offsets/bytecounts) of the segments overlapping the box."""
        sh, sw = self._seg
        n_r, n_c = -(-self.height // sh), -(-self.width // sw)
        planes = range(self.bands) if self._planar else range(1)
        return [p * n_r * n_c + i * n_c + j for p in planes
                for i in range(r0 // sh, (r1 - 1) // sh + 1)
                for j in range(c0 // sw, (c1 - 1) // sw + 1)]

    def _read_box(self, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        """``[C, r1-r0, c1-c0]`` for a box inside the image, decoded segment by segment."""
        self._ensure_open()
        out = np.zeros((self.bands, r1 - r0, c1 - c0), self.dtype)
        index = sorted(self._segments(r0, r1, c0, c1), key=lambda k: self._offsets[k])
        try:
            for k in index:
                data = self._read_bytes(self._offsets[k], self._counts[k])
                seg, (plane, _, y, x, _), _ = self._decode(data, k, jpegtables=self._jpegtables)
                if seg is not None:
                    self._place(out, seg, plane, y, x, r0, c0)
        except (ValueError, RuntimeError, OSError, tifffile.TiffFileError) as exc:
            raise InputError(f"cannot decode rows {r0}:{r1}, cols {c0}:{c1} of '{self.path}': "
                             f"{exc}. Re-copy or re-generate the file.") from exc
        return out

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

    def _place(self, out: np.ndarray, seg: np.ndarray, plane: int, y: int, x: int,
               r0: int, c0: int) -> None:
        """Copy the overlap of a decoded segment ``[1, h, w, S]`` into ``out[C, h, w]``."""
        seg = seg[0]
        ys, ye = max(y, r0), min(y + seg.shape[0], r0 + out.shape[1])
        xs, xe = max(x, c0), min(x + seg.shape[1], c0 + out.shape[2])
        if ye <= ys or xe <= xs:
            return
        part = seg[ys - y:ye - y, xs - x:xe - x]  # [h, w, S]
        target = out[plane:plane + 1] if self._planar else out
        target[:, ys - r0:ye - r0, xs - c0:xe - c0] = np.moveaxis(part, -1, 0)


def read_raster(path: str | os.PathLike[str], *, nodata: float | None = None) -> np.ndarray:
    """Read a whole (small) raster as ``[C, H, W]``: for tests and small images only."""
    with RasterReader(path, nodata=nodata) as reader:
        return reader.read(Window(0, 0, reader.height, reader.width))
