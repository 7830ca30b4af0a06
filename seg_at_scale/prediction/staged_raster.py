"""``seg-predict staged=true``: a raster predicted stage by stage, into the usual store.

The stages (:mod:`seg_at_scale.tiling.staged.stages`) read the image window by window from the
raster (normalised and filled as the tile engine reads it), keep their feature maps and
the logits in files in ``.<output name>.staged`` beside the output, and the logits of
every tile the store still lacks are turned into labels (and probabilities) exactly as the
tiled path turns its tiles' logits, then written as that tile's chunk. Store, resume,
COG / Zarr, STAC and preview are the tiled path's. A killed run leaves the folder behind;
the next run of that output removes it before it starts.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from seg_at_scale.data.windows import RasterWindows
from seg_at_scale.errors import ConfigError
from seg_at_scale.models.contract import Staged, require
from seg_at_scale.prediction.options import PredictOptions
from seg_at_scale.prediction.store import PredictionStore
from seg_at_scale.tiling.engine import Batch
from seg_at_scale.tiling.geometry import TileGrid, Window
from seg_at_scale.tiling.staged import Stage, StagePlan, plan_stages, read_map, staged_maps

__all__ = ["check_staged", "plan_staged", "predict_staged_raster", "stage_folder"]


def check_staged(model: nn.Module, options: PredictOptions, world: int) -> list[Stage]:
    """The model's stages, or a one-line refusal before any work.

    The one check every path calls (a scene, an archive) before anything is written.
    """
    require(model, Staged, "staged=true", "use staged=false (tiles) or model=smp / its presets")
    if world > 1:
        raise ConfigError(f"staged=true runs in one process (processes={world}): use "
                          "processes=1, or staged=false to share the tiles between processes")
    if options.tta is not None:
        raise ConfigError(f"staged=true with tta={options.tta!r}: each view would be a "
                          "staged run of its own; use tta=null, or staged=false")
    return cast(Staged, model).stages()  # require(model, Staged) above


def plan_staged(stages: list[Stage], grid: TileGrid, bands: int, output: Path,
                options: PredictOptions) -> StagePlan:
    """The stages' plan; refused before any work when their maps cannot fit the disk.

    The maps go to files beside ``output`` (:func:`stage_folder`); at their peak they need
    :meth:`StagePlan.disk_bytes` of the extended scene, which must fit what is free there,
    counting a killed run's folder of the same output as free (it is removed first).
    """
    plan = plan_stages(stages, bands, grid.footprint.align)
    itemsize = 2 if options.autocast in (torch.bfloat16, torch.float16) else 4
    need = plan.disk_bytes(stages, grid.extended.height, grid.extended.width,
                           itemsize=itemsize)
    folder = _folder_of(output)
    where = next(p for p in (folder.parent, *folder.parent.parents) if p.exists())
    free = shutil.disk_usage(where).free + _bytes_under(folder)
    if need > free:
        raise ConfigError(
            f"staged=true: the maps between stages of this {grid.height} x {grid.width} scene "
            f"need {_size(need)} in '{folder}' (beside output='{output}') at their peak, but "
            f"{_size(free)} is free there; free space or write the output on a larger disk, "
            "or use staged=false (tiles: no maps on disk)")
    return plan


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _folder_of(output: Path) -> Path:
    return output.parent / f".{output.name}.staged"


def _bytes_under(folder: Path) -> int:
    """The disk space the files under ``folder`` hold (blocks, not apparent sizes)."""
    if not folder.is_dir():
        return 0
    return sum(p.lstat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


@contextlib.contextmanager
def stage_folder(output: Path) -> Iterator[Path]:
    """The folder a staged run of ``output`` keeps its maps in, removed when the block ends.

    It starts empty: a killed run's folder of the same output is removed first (the
    output's lock keeps two runs of one output apart).
    """
    folder = _folder_of(output)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _SourceMap:
    """The normalised image as a map read by window (the extended image's shape)."""

    def __init__(self, source: RasterWindows, bands: int, grid: TileGrid) -> None:
        self.source = source
        self.shape = torch.Size((1, bands, grid.extended.height, grid.extended.width))

    def read(self, rows: slice, cols: slice) -> Tensor:
        window = Window(rows.start, cols.start, rows.stop - rows.start, cols.stop - cols.start)
        return torch.from_numpy(self.source.read(window)[0])[None]


def predict_staged_raster(stages: list[Stage], plan: StagePlan, source: RasterWindows,
                          grid: TileGrid, todo: list[Batch], store: PredictionStore,
                          options: PredictOptions, stats: Any, output: Path, bar: Any,
                          outputs: Any) -> None:
    """Compute the logits stage by stage, then write every tile of ``todo`` to ``store``.

    ``plan`` is :func:`plan_staged`'s; ``outputs(y, invalid)`` turns one tile's logits
    ``[K, h, w]`` into ``(labels, probs)`` as the tiled path does; the maps live in
    :func:`stage_folder` of ``output``.
    """
    with stage_folder(output) as folder:
        if todo:
            _predict(stages, plan, source, grid, todo, store, options, stats, folder, bar,
                     outputs)


def _predict(stages: list[Stage], plan: StagePlan, source: RasterWindows, grid: TileGrid,
             todo: list[Batch], store: PredictionStore, options: PredictOptions, stats: Any,
             folder: Path, bar: Any, outputs: Any) -> None:
    t0 = time.perf_counter()
    image = _SourceMap(source, source.reader.bands, grid)
    budget = options.stage_memory_mb * 2**20 // 4
    with torch.inference_mode(), staged_maps(
            stages, image, align=grid.footprint.align, budget=budget, plan=plan,
            channels_last=options.channels_last, autocast=options.autocast,
            folder=folder) as logits:
        stats.model_s += time.perf_counter() - t0
        for batch in todo:
            for tile in batch.tiles:
                c = tile.core
                if store.done(tile):
                    continue
                y = read_map(logits, slice(c.row, c.row_end), slice(c.col, c.col_end))[0]
                labels, probs = outputs(y, source.load(c)[1])
                store.write(tile, labels, probs)
                stats.tiles_computed += 1
                bar.update(1)
