"""Whole-image prediction from a raster file to a raster file, with bounded memory.

Tiles are read from the input (windowed, reflect/zero extended at the border), pushed
through the model, cropped to their cores, and streamed row band by row band into a
tiled TIFF mask that carries the input's GeoTIFF tags. Memory holds one row band of the
output and a couple of tiles, whatever the image size. The next tile is read on a
background thread while the model runs (numpy decoding and torch both release the GIL).

Example::

    from seg_at_scale.inference import Normalizer, predict_raster
    stats = predict_raster(model, "scene.tif", "scene_mask.tif", tile_size=1024,
                           normalizer=Normalizer(scale=1 / 255))
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from seg_at_scale.errors import InputError
from seg_at_scale.io import RasterReader, check_output_path, write_raster_bands
from seg_at_scale.tiling import Footprint, Tile, TileGrid, Window, footprint, make_grid
from seg_at_scale.tiling.statistics import image_pool_mean_of, uses_image_pool

__all__ = ["Normalizer", "PredictionStats", "predict_raster", "read_valid", "IGNORE_INDEX"]

IGNORE_INDEX = 255


@dataclass(frozen=True)
class Normalizer:
    """``(x * scale - mean) / std`` per band, applied to raw samples ``[C, h, w]``."""

    scale: float = 1.0 / 255.0
    mean: Sequence[float] = (0.0,)
    std: Sequence[float] = (1.0,)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.standardize(self.rescale(x))

    def rescale(self, x: np.ndarray) -> np.ndarray:
        """Raw samples to float32 in about ``[0, 1]`` (where photometric augmentation acts)."""
        return x.astype(np.float32) * np.float32(self.scale)

    def standardize(self, x: np.ndarray) -> np.ndarray:
        """``(x - mean) / std`` per band of a rescaled ``[C, h, w]`` array."""
        c = x.shape[0]
        mean = np.asarray(self.mean, np.float32).reshape(-1, 1, 1)
        std = np.asarray(self.std, np.float32).reshape(-1, 1, 1)
        if mean.shape[0] not in (1, c) or std.shape[0] not in (1, c):
            raise InputError(f"normalization has {mean.shape[0]} means / {std.shape[0]} stds "
                             f"for {c} bands; give one value per band (data.mean / data.std)")
        return (x - mean) / std


@dataclass
class PredictionStats:
    """What a prediction run did, and where its time went (seconds).

    ``read_s`` is spent on a background thread, overlapped with the model; ``read_wait_s``
    is how long the model waited for it. ``statistics_s`` is the first pass of a model with
    whole-image statistics (Gated-SCNN's image pooling), 0 otherwise. ``write_s`` is the
    rest of the wall time (encoding and writing the output, bookkeeping).
    """

    path: Path
    height: int
    width: int
    tiles: int
    efficiency: float
    read_s: float = 0.0
    read_wait_s: float = 0.0
    model_s: float = 0.0
    write_s: float = 0.0
    total_s: float = 0.0
    statistics_s: float = 0.0
    class_pixels: list[int] = field(default_factory=list)

    @property
    def mpix_per_s(self) -> float:
        return self.height * self.width / 1e6 / max(self.total_s, 1e-9)


def _fill(fp: Footprint) -> str:
    return "reflect" if fp.padding == "valid" else "constant"


def read_valid(reader: RasterReader, window: Window, fill: str
               ) -> tuple[np.ndarray, np.ndarray | None]:
    """Raw window ``[C, h, w]`` with no-data samples zeroed, and its no-data mask ``[h, w]``.

    A pixel is no-data when all its bands equal the reader's nodata value (NaN allowed);
    the mask is None when there is none. NaN in a float image without a nodata value is
    refused: it would silently poison the model's output.
    """
    raw = reader.read(window, fill=fill)  # type: ignore[arg-type]
    if reader.nodata is not None:
        nd = reader.nodata
        bad = np.isnan(raw) if np.isnan(nd) else raw == nd
        if not bad.any():
            return raw, None
        return np.where(bad, 0, raw), bad.all(axis=0)
    if reader.is_float and np.isnan(raw).any():
        raise InputError(
            f"'{reader.path}' has NaN pixels in rows {window.row}..{window.row_end} and no "
            "nodata value; set one (seg-predict: nodata=<value>; training: data.nodata=<value>,"
            " e.g. nan) so those pixels are masked, or clean the file")
    return raw, None


def _load(reader: RasterReader, tile: Tile, fp: Footprint, norm: Normalizer
          ) -> tuple[np.ndarray, np.ndarray | None]:
    """Normalised input window and its no-data mask (None when all pixels are valid)."""
    raw, invalid = read_valid(reader, tile.read, _fill(fp))
    return norm(raw), invalid


def _core_labels(model: nn.Module, x: np.ndarray, invalid: np.ndarray | None, tile: Tile,
                 device: torch.device, autocast: torch.dtype | None, channels_last: bool
                 ) -> np.ndarray:
    t = torch.from_numpy(x).unsqueeze(0).to(device)
    if channels_last:
        t = t.contiguous(memory_format=torch.channels_last)
    ctx = (torch.autocast(device.type, dtype=autocast) if autocast is not None
           else contextlib.nullcontext())
    with torch.inference_mode(), ctx:
        y = model(t)
    c = tile.crop
    # argmax over classes reads K strided planes in NCHW; in NHWC the classes of a pixel are
    # adjacent, ~3x faster on CPU (ties still go to the first class)
    core = y[:, :, c.row : c.row_end, c.col : c.col_end]
    labels = core.contiguous(memory_format=torch.channels_last).argmax(1)[0].to(torch.uint8)
    out = labels.cpu().numpy()
    if invalid is not None:  # core pixels sit at crop + (read offset 0 for same/valid)
        off_r, off_c = tile.core.row - tile.read.row, tile.core.col - tile.read.col
        out[invalid[off_r : off_r + c.height, off_c : off_c + c.width]] = IGNORE_INDEX
    return out


def _bands(model: nn.Module, reader: RasterReader, grid: TileGrid, norm: Normalizer,
           device: torch.device, autocast: torch.dtype | None, channels_last: bool,
           stats: PredictionStats) -> Iterator[np.ndarray]:
    """Yield the output mask row band by row band, prefetching the next tile."""
    fp = grid.footprint
    tiles = list(grid)
    with ThreadPoolExecutor(1) as pool:
        pending: Future | None = pool.submit(_timed_load, reader, tiles[0], fp, norm)
        k = 0
        for band_tiles in grid.row_bands():
            band = np.empty((band_tiles[0].core.height, grid.width), np.uint8)
            for tile in band_tiles:
                assert pending is not None
                t0 = time.perf_counter()
                (x, invalid), dt = pending.result()
                stats.read_wait_s += time.perf_counter() - t0
                stats.read_s += dt
                k += 1
                pending = pool.submit(_timed_load, reader, tiles[k], fp, norm) \
                    if k < len(tiles) else None
                t0 = time.perf_counter()
                band[:, tile.core.col : tile.core.col_end] = _core_labels(
                    model, x, invalid, tile, device, autocast, channels_last)
                stats.model_s += time.perf_counter() - t0
            yield band


def _image_pool_pass(model: nn.Module, reader: RasterReader, grid: TileGrid, norm: Normalizer,
                     device: torch.device, autocast: torch.dtype | None, channels_last: bool
                     ) -> torch.Tensor:
    """Pass 1 for Gated-SCNN: the whole image's pooled-feature mean, streamed tile by tile."""
    def inputs() -> Iterator[tuple[Tile, torch.Tensor]]:
        for tile in grid:
            x = torch.from_numpy(_load(reader, tile, grid.footprint, norm)[0]).unsqueeze(0)
            yield tile, (x.contiguous(memory_format=torch.channels_last) if channels_last else x)

    ctx = (torch.autocast(device.type, dtype=autocast) if autocast is not None
           else contextlib.nullcontext())
    with torch.inference_mode(), ctx:
        return image_pool_mean_of(model, inputs(), grid)  # type: ignore[arg-type]


def _timed_load(reader: RasterReader, tile: Tile, fp: Footprint, norm: Normalizer
                ) -> tuple[tuple[np.ndarray, np.ndarray | None], float]:
    t0 = time.perf_counter()
    out = _load(reader, tile, fp, norm)
    return out, time.perf_counter() - t0


def predict_raster(model: nn.Module, image: str | os.PathLike[str] | RasterReader,
                   output: str | os.PathLike[str], *, q: int | None = None,
                   tile_size: int | None = None, fp: Footprint | None = None,
                   normalizer: Normalizer | None = None, autocast: torch.dtype | None = None,
                   channels_last: bool = False, nodata: float | None = None,
                   overwrite: bool = False, tiff_tile: int = 256,
                   compression: str | None = "zlib") -> PredictionStats:
    """Predict class labels for a whole raster file, streaming, exactly as untiled.

    A model with a whole-image statistic (Gated-SCNN's image-level pooling) takes two
    passes over the tiles: the first streams them through the backbone to average the
    pooled features over the whole image, the second predicts with that average fixed
    (:mod:`seg_at_scale.tiling.statistics`).

    Args:
        model: network in eval mode, on the device it should run on.
        image: input raster path (or an open reader).
        output: mask path (uint8 tiled TIFF, 255 = no data); written to a temporary name
            and renamed when complete.
        q: tiles per side, or
        tile_size: largest input window per tile (the usual choice for huge images).
        fp: footprint; computed from the model when omitted.
        normalizer: raw samples to model input; defaults to ``x / 255``.
        autocast: e.g. ``torch.bfloat16`` for the fast path; None = exact fp32.
        channels_last: run convolutions in NHWC layout (faster on CPU).
        nodata: input no-data value (overrides the file's tag); such pixels get 255.
        overwrite: replace an existing output.
        tiff_tile: TIFF tile side of the output.
        compression: output compression.

    Returns:
        :class:`PredictionStats` with timings and the class histogram.
    """
    out_path = check_output_path(output, overwrite)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    reader = image if isinstance(image, RasterReader) else RasterReader(image, nodata=nodata)
    fp = fp or footprint(model)
    grid = make_grid(reader.height, reader.width, fp, q=q, tile_size=None if q else tile_size)
    device = next(model.parameters()).device
    stats = PredictionStats(out_path, reader.height, reader.width, len(grid), grid.efficiency)
    hist = np.zeros(256, np.int64)

    def counted() -> Iterator[np.ndarray]:
        for band in _bands(model, reader, grid, normalizer or Normalizer(), device, autocast,
                           channels_last, stats):
            # torch counts uint8 directly; np.bincount would first copy the band to int64
            hist[:] += torch.bincount(torch.from_numpy(band).reshape(-1), minlength=256).numpy()
            yield band

    t0 = time.perf_counter()
    pooled = None
    if uses_image_pool(model):  # a whole-image statistic: pass 1 over the tiles computes it
        pooled = _image_pool_pass(model, reader, grid, normalizer or Normalizer(), device,
                                  autocast, channels_last)
        stats.statistics_s = time.perf_counter() - t0
    with (model.fixed_image_pool(pooled) if pooled is not None  # type: ignore[operator]
          else contextlib.nullcontext()):
        write_raster_bands(out_path, (1, reader.height, reader.width), np.uint8, counted(),
                           tile=(tiff_tile, tiff_tile), compression=compression,
                           geotags=reader.geotags, nodata=IGNORE_INDEX, overwrite=overwrite)
    stats.total_s = time.perf_counter() - t0
    stats.write_s = max(0.0, stats.total_s - stats.statistics_s - stats.read_wait_s
                        - stats.model_s)
    stats.class_pixels = [int(v) for v in hist[:IGNORE_INDEX]]
    return stats
