"""Streaming (Big/Geo)TIFF writer: rows of bands in, one TIFF out, never the whole image.

Predictions are produced one tile row at a time; :func:`write_raster_bands` re-chunks those
row bands (any heights) into rows of TIFF tiles (or strips) and hands them to ``tifffile``
as an iterator, so memory stays at one band plus one row of tiles. The file is written
under a temporary name in the same directory and renamed onto the target only when
complete: a crash never leaves a half-written output under the real name.

>>> import numpy as np
>>> mask = np.zeros((1, 301, 257), np.uint8)
>>> write_raster("mask.tif", mask, overwrite=True)  # doctest: +SKIP
"""

from __future__ import annotations

import glob
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import tifffile

from seg_at_scale.errors import InputError, OutputExistsError
from seg_at_scale.io.geotags import GDAL_NODATA_TAG, GeoTags

__all__ = [
    "BIGTIFF_THRESHOLD",
    "check_output_path",
    "remove_stale_temporaries",
    "discard",
    "listed_once",
    "temporary_path",
    "write_atomic",
    "write_raster",
    "write_raster_bands",
]

#: A reduced-resolution page: its ``(height, width)`` and a function giving its row bands.
Overview = tuple[tuple[int, int], Callable[[], Iterable[np.ndarray]]]

#: Uncompressed image bytes from which BigTIFF is chosen automatically (as ``tifffile``
#: does: 4 GiB minus 32 MiB of head room for tags and offsets).
BIGTIFF_THRESHOLD = 2**32 - 2**25
#: Target uncompressed strip size for striped files (libtiff's default strip size).
_STRIP_BYTES = 8192


def check_output_path(path: str | os.PathLike[str], overwrite: bool, *,
                      key: str = "output") -> Path:
    """Refuse to replace an existing output unless asked to.

    Args:
        path: output path.
        overwrite: allow replacing an existing file.
        key: the config key / argument name shown in the message.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        OutputExistsError: ``path`` exists and ``overwrite`` is false.

    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise OutputExistsError(f"{key} '{path}' already exists; pass overwrite=true to replace "
                                "it (or choose another path)")
    return path


def _check_tile(tile: tuple[int, int], path: Path) -> None:
    if len(tile) != 2 or any(int(t) < 16 or int(t) % 16 for t in tile):
        raise InputError(f"writing '{path}': tile={tuple(tile)} is not a TIFF tile size; "
                         "use multiples of 16, e.g. (256, 256), or tile=None for strips")


def temporary_path(path: Path, tag: str = "partial") -> Path:
    """A unique hidden name beside ``path``: two writers of one output never share it.

    >>> temporary_path(Path("out/mask.tif")).name.startswith(".mask.tif.partial.")
    True
    """
    return path.with_name(f".{path.name}.{tag}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")


def remove_stale_temporaries(path: Path) -> int:
    """Remove the temporary files of ``path`` whose writer is dead; returns how many.

    The names this project writes beside an output, ``.{name}.{tag}.{pid}...``
    (:func:`temporary_path`, a COG's mode levels), of a process that no longer exists: a
    killed writer leaves them, as large as the output's uncompressed samples. A live
    writer's (another run of the same output, which its lock refuses) are kept.
    """
    gone = 0
    listed = _LISTED.get(os.path.abspath(path.parent))
    prefix = f".{path.name}."
    found = (path.parent.glob(f".{glob.escape(path.name)}.*") if listed is None
             else (path.parent / name for name in listed if name.startswith(prefix)))
    for tmp in found:
        _, _, tail = tmp.name[len(path.name) + 2:].partition(".")
        pid = tail.split("-", 1)[0].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            with suppress(OSError):
                if tmp.is_dir() and not tmp.is_symlink():  # a store being discarded
                    shutil.rmtree(tmp)
                else:
                    tmp.unlink()
                gone += 1
    return gone


def discard(folder: Path, beside: Path) -> None:
    """Delete ``folder`` (a working store of the output ``beside``) with no half left.

    It is first renamed to a temporary name of ``beside`` (:func:`temporary_path`): a
    process killed while deleting leaves that name, which :func:`remove_stale_temporaries`
    of ``beside`` removes, never a half-deleted store under the store's own name.
    """
    doomed = temporary_path(beside, "discarded")
    try:
        os.rename(folder, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


#: Folders listed once by :func:`listed_once`: their hidden names.
_LISTED: dict[str, frozenset[str]] = {}


@contextmanager
def listed_once(folders: Iterable[Path]) -> Iterator[None]:
    """Within: outputs in ``folders`` find their temporaries in one listing made here.

    :func:`remove_stale_temporaries` of such an output looks among the hidden names listed
    on entry instead of listing the folder.

    An archive finalises thousands of scenes in one folder: listing it per output reads
    ~3N names N times (5.2 ms per output at 3,000 scenes on a local disk, 113x the one
    listing: ``experiments/bench_sweep.py``; far more on a network filesystem). A dead
    writer's temporaries are there before the run, and those made after belong to live
    writers, which are kept anyway.
    """
    keys = []
    for folder in dict.fromkeys(os.path.abspath(f) for f in folders):
        try:
            with os.scandir(folder) as entries:
                _LISTED[folder] = frozenset(e.name for e in entries if e.name.startswith("."))
        except FileNotFoundError:
            _LISTED[folder] = frozenset()
        keys.append(folder)
    try:
        yield
    finally:
        for folder in keys:
            _LISTED.pop(folder, None)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _check_band(band: np.ndarray, c: int, w: int, dtype: np.dtype, path: Path) -> np.ndarray:
    band = np.asarray(band)
    if band.ndim == 2 and c == 1:
        band = band[None]
    if band.ndim != 3 or band.shape[0] != c or band.shape[2] != w:
        raise InputError(f"writing '{path}': a band has shape {band.shape} but the image is "
                         f"{c} bands x {w} columns; yield arrays [{c}, rows, {w}]")
    if band.dtype != dtype:
        if not np.can_cast(band.dtype, dtype, "same_kind"):
            raise InputError(f"writing '{path}': a band has dtype {band.dtype} but the image "
                             f"is {dtype}; convert the band with .astype({dtype})")
        band = band.astype(dtype)
    return band


def _row_blocks(bands: Iterable[np.ndarray], shape: tuple[int, int, int], dtype: np.dtype,
                block: int, path: Path) -> Iterator[np.ndarray]:
    """Re-chunk row bands ``[C, h_k, W]`` into blocks ``[block, W, C]`` (last one zero-padded).

    The yielded buffer is reused: consumers must copy what they keep.
    """
    c, h, w = shape
    buf = np.zeros((block, w, c), dtype)
    filled = total = 0
    for band in bands:
        band = _check_band(band, c, w, dtype, path)
        total += band.shape[1]
        if total > h:
            raise InputError(f"writing '{path}': the bands have more than the {h} rows of "
                             f"the image (at least {total}); yield exactly {h} rows")
        pos = 0
        while pos < band.shape[1]:
            n = min(block - filled, band.shape[1] - pos)
            buf[filled:filled + n] = np.moveaxis(band[:, pos:pos + n], 0, -1)
            filled, pos = filled + n, pos + n
            if filled == block:
                yield buf
                filled = 0
    if total != h:
        raise InputError(f"writing '{path}': the bands have {total} rows but the image has "
                         f"{h}; yield exactly {h} rows")
    if filled:
        buf[filled:] = 0
        yield buf


def _tiles(blocks: Iterator[np.ndarray], tile: tuple[int, int], w: int) -> Iterator[np.ndarray]:
    """Split each tile row ``[TH, W, C]`` into tiles ``[TH, TW, C]`` (copies, zero-padded)."""
    th, tw = tile
    for block in blocks:
        for x in range(0, w, tw):
            piece = np.zeros((th, tw, block.shape[2]), block.dtype)
            part = block[:, x:x + tw]
            piece[:, :part.shape[1]] = part
            yield piece


def _strips(blocks: Iterator[np.ndarray], rows_left: int, compression: str | None
            ) -> Iterator[bytes]:
    """Encode each strip ``[RPS, W, C]`` (the last one cut to the image) to TIFF bytes."""
    encode = _strip_encoder(compression)
    for block in blocks:
        rows = min(block.shape[0], rows_left)
        rows_left -= rows
        yield encode(np.ascontiguousarray(block[:rows]))


def _strip_encoder(compression: str | None) -> Any:
    """Return the codec ``tifffile`` would use for ``compression`` (no predictor)."""
    if not compression:
        return lambda data: data.tobytes()
    name = compression.upper()
    code = 8 if name == "ZLIB" else int(tifffile.COMPRESSION[name])
    return tifffile.TIFF.COMPRESSORS[code]


def _fits(value: float, dtype: np.dtype) -> bool:
    """Whether ``value`` is exactly representable in ``dtype`` (NaN only for floats)."""
    if np.issubdtype(dtype, np.floating):
        return True
    if not float(value).is_integer():
        return False
    info = np.iinfo(dtype) if np.issubdtype(dtype, np.integer) else None
    return info is not None and info.min <= value <= info.max


def _format_nodata(nodata: float) -> str:
    """GDAL's text form: ``"-9999"`` for whole numbers, else the shortest exact repr."""
    value = float(nodata)
    return str(int(value)) if value.is_integer() else repr(value)


def _extratags(geotags: GeoTags | None, nodata: float | None, dtype: np.dtype,
               path: Path) -> list[tuple[Any, ...]]:
    if nodata is not None and not _fits(nodata, dtype):
        raise InputError(f"writing '{path}': nodata={nodata} cannot be stored in {dtype}; "
                         "choose a nodata value inside the dtype's range")
    tags: list[tuple[Any, ...]] = [] if geotags is None else geotags.to_extratags()
    if nodata is not None:
        tags.append((GDAL_NODATA_TAG, 2, 0, _format_nodata(nodata), True))
    return tags


def _use_bigtiff(bigtiff: bool | None, shape: tuple[int, int, int], dtype: np.dtype) -> bool:
    if bigtiff is not None:
        return bigtiff
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize >= BIGTIFF_THRESHOLD


def write_atomic(path: Path, write: Any) -> Path:
    """Run ``write(tmp_path)``, then rename onto ``path``; remove the temporary on failure."""
    tmp = temporary_path(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            tmp.unlink()
        raise
    return path


def write_raster_bands(path: str | os.PathLike[str], shape: tuple[int, int, int],
                       dtype: npt.DTypeLike, bands: Iterable[np.ndarray], *,
                       tile: tuple[int, int] | None = (256, 256), compression: str | None = "zlib",
                       bigtiff: bool | None = None, geotags: GeoTags | None = None,
                       nodata: float | None = None, overwrite: bool = False,
                       atomic: bool = True, overviews: Sequence[Overview] = ()) -> Path:
    """Write a raster from row bands, top to bottom, with memory of one band + one tile row.

    Args:
        path: output file; written as ``.{name}.partial`` first, renamed when complete.
        shape: ``(C, H, W)``. ``C == 1`` writes a plain 2-D ``[H, W]`` image.
        dtype: sample dtype; bands of another dtype of the same kind are cast.
        bands: arrays ``[C, h_k, W]`` (or ``[h_k, W]`` if ``C == 1``), any ``h_k`` summing
            to ``H``.
        tile: TIFF tile ``(height, width)``, multiples of 16; None writes strips.
        compression: ``tifffile`` compression name ("zlib", "lzw", "zstd", ...) or None.
        bigtiff: force BigTIFF on/off; None chooses it from ``BIGTIFF_THRESHOLD``.
        geotags: GeoTIFF tags to write (e.g. ``reader.geotags`` of the input).
        nodata: written as the GDAL_NODATA tag.
        overwrite: replace an existing ``path``.
        atomic: write under a temporary name and rename (False: write ``path`` itself,
            for callers that own a temporary name already).
        overviews: reduced-resolution pages written after the main one (TIFF
            NewSubfileType 1, which GDAL reads as internal overviews): ``((h, w), make)``
            where ``make()`` returns that level's row bands; called once the previous
            page is complete. Tiled output only.

    Returns:
        ``path``.

    Raises:
        OutputExistsError: ``path`` exists and ``overwrite`` is false.
        InputError: a band's shape or dtype does not fit, or the rows do not sum to ``H``.
            The partial file is removed and an existing ``path`` is left untouched.

    """
    path = check_output_path(path, overwrite)
    dt = np.dtype(dtype)
    c, h, w = (int(v) for v in shape)
    if min(c, h, w) < 1:
        raise InputError(f"writing '{path}': shape {shape} must be (bands, rows, cols) >= 1")
    if tile is not None:
        _check_tile(tile, path)
        block = int(tile[0])
        data: Iterator[Any] = _tiles(_row_blocks(bands, (c, h, w), dt, block, path), tile, w)
        buffersize = block * (-(-w // tile[1]) * tile[1]) * c * dt.itemsize  # one tile row
    else:
        block = max(1, min(h, _STRIP_BYTES // (w * c * dt.itemsize)))
        data = _strips(_row_blocks(bands, (c, h, w), dt, block, path), h, compression)
        buffersize = None

    if overviews and tile is None:
        raise InputError(f"writing '{path}': overviews need a tiled file; pass tile=(h, w)")

    def write(tmp: Path) -> None:
        with tifffile.TiffWriter(tmp, bigtiff=_use_bigtiff(bigtiff, (c, h, w), dt)) as tw:
            tw.write(data, shape=(h, w) if c == 1 else (h, w, c), dtype=dt, tile=tile,
                     rowsperstrip=None if tile else block, compression=compression,
                     photometric="rgb" if c == 3 else "minisblack", planarconfig="contig",
                     extratags=_extratags(geotags, nodata, dt, path), metadata=None,
                     buffersize=buffersize)
            for (oh, ow), make in overviews:
                assert tile is not None
                level = _tiles(_row_blocks(make(), (c, oh, ow), dt, block, path), tile, ow)
                tw.write(level, shape=(oh, ow) if c == 1 else (oh, ow, c), dtype=dt,
                         tile=tile, compression=compression, subfiletype=1,
                         photometric="rgb" if c == 3 else "minisblack", planarconfig="contig",
                         metadata=None, buffersize=buffersize)

    if not atomic:
        write(path)
        return path
    return write_atomic(path, write)


def write_raster(path: str | os.PathLike[str], array: np.ndarray, *,
                 tile: tuple[int, int] | None = (256, 256), compression: str | None = "zlib",
                 planar: bool = False, bigtiff: bool | None = None,
                 geotags: GeoTags | None = None, nodata: float | None = None,
                 overwrite: bool = False) -> Path:
    """Write an in-memory raster ``[C, H, W]`` or ``[H, W]`` (single band).

    Args:
        path: output file (written atomically, see :func:`write_raster_bands`).
        array: the image.
        tile: TIFF tile ``(height, width)`` or None for strips.
        compression: ``tifffile`` compression name or None.
        planar: store bands as separate planes (SYX) instead of interleaved (YXS).
        bigtiff: force BigTIFF on/off; None = automatic.
        geotags: GeoTIFF tags to write.
        nodata: written as the GDAL_NODATA tag.
        overwrite: replace an existing ``path``.

    Returns:
        ``path``.

    """
    arr = np.asarray(array)
    arr = arr[None] if arr.ndim == 2 else arr
    if arr.ndim != 3:
        raise InputError(f"writing '{path}': array has shape {arr.shape}; expected [C, H, W] "
                         "or [H, W]")
    c, h, w = arr.shape
    if not planar or c == 1:
        step = tile[0] if tile else 256
        bands = (arr[:, r:r + step] for r in range(0, h, step))
        return write_raster_bands(path, arr.shape, arr.dtype, bands, tile=tile,
                                  compression=compression, bigtiff=bigtiff, geotags=geotags,
                                  nodata=nodata, overwrite=overwrite)
    out = check_output_path(path, overwrite)
    if tile is not None:
        _check_tile(tile, out)
    rows = max(1, min(h, _STRIP_BYTES // (w * arr.dtype.itemsize)))

    def write(tmp: Path) -> None:
        with tifffile.TiffWriter(tmp, bigtiff=_use_bigtiff(bigtiff, arr.shape, arr.dtype)) as tw:
            tw.write(np.ascontiguousarray(arr), tile=tile, rowsperstrip=None if tile else rows,
                     compression=compression, planarconfig="separate",
                     photometric="rgb" if c == 3 else "minisblack",
                     extratags=_extratags(geotags, nodata, arr.dtype, out), metadata=None)

    return write_atomic(out, write)
