"""LightningDataModule yielding halo tiles of large scenes.

Training reads either every tile of every image's grid (``mode="grid"``: the optimiser
steps once per image on its exact whole-image gradient) or random aligned tiles
(``mode="random"``: ordinary crop training, batched). Validation always walks the whole
grid of every validation scene, so ``val/miou`` is the whole-image metric.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from torch.utils.data import DataLoader

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.data.samplers import (
    EpochSampler,
    ImageGroupedSampler,
    ShardedImageSampler,
    ShardedTiles,
    padded_slots,
)
from seg_at_scale.data.scenes import Scene, find_scenes, validate_scene
from seg_at_scale.data.tiles import GridTiles, RandomTiles, pad_collate
from seg_at_scale.data.transforms import build_augment
from seg_at_scale.errors import ConfigError
from seg_at_scale.tiling import Footprint

__all__ = ["TileDataModule"]

log = logging.getLogger(__name__)


class TileDataModule(pl.LightningDataModule):
    """Halo tiles of the scenes under ``root/<split>/``.

    Args:
        root: folder with ``train/``, ``val/`` (and ``test/``) sub-folders of scenes.
        footprint: the model's footprint (halo, alignment, padding).
        num_classes: number of classes; masks are checked against it.
        mode: ``"grid"`` (exact whole-image gradient) or ``"random"`` (random tiles).
        q: tiles per side for grid tiling, or
        tile_size: largest input window for grid tiling (train in grid mode, and val).
        core_size: output side of random training tiles.
        samples_per_epoch: random tiles per epoch.
        batch_size: tiles per batch (grid mode uses 1: tiles differ in size).
        num_workers: data-loader processes.
        scale, mean, std: input normalisation ``(x * scale - mean) / std`` per band.
        class_weights: loss weights (also used for the grid-mode normaliser).
        ignore_index: label that carries no loss.
        nodata: input no-data value (overrides the files' tags).
        augment: keyword arguments of :func:`build_augment` (random mode), or None.
        seed: sampling and augmentation seed.
        mask_bands: label bands per mask (1; or one per plane, e.g. 3 detector planes).
        scenes: scenes already validated per split (:func:`~seg_at_scale.data.preflight.
            preflight`), so their files are not read again; other splits are validated when
            first used.
    """

    def __init__(self, root: str, footprint: Footprint, num_classes: int, *,
                 mode: str = "random", q: int | None = None, tile_size: int | None = 512,
                 core_size: int = 128, samples_per_epoch: int = 256, batch_size: int = 8,
                 num_workers: int = 0, scale: float = 1 / 255,
                 mean: Sequence[float] = (0.0,), std: Sequence[float] = (1.0,),
                 class_weights: Sequence[float] | None = None, ignore_index: int = 255,
                 nodata: float | None = None, augment: dict[str, Any] | None = None,
                 seed: int = 0, mask_bands: int = 1,
                 scenes: Mapping[str, list[Scene]] | None = None) -> None:
        super().__init__()
        if mode not in ("grid", "random"):
            raise ConfigError(f"tiling.mode={mode!r}: use 'grid' (exact whole-image gradient) "
                              "or 'random' (random aligned tiles)")
        self.root, self.fp, self.num_classes = Path(root), footprint, num_classes
        self.mode, self.q, self.tile_size, self.core_size = mode, q, tile_size, core_size
        self.samples, self.batch_size, self.num_workers = samples_per_epoch, batch_size, num_workers
        self.normalizer = Normalizer(scale, tuple(mean), tuple(std))
        self.class_weights = None if class_weights is None else list(class_weights)
        self.ignore_index, self.nodata, self.seed = ignore_index, nodata, seed
        self.augment = augment
        self.mask_bands = mask_bands
        self.scenes: dict[str, list[Scene]] = dict(scenes or {})

    def scenes_of(self, split: str) -> list[Scene]:
        """Validated scenes of a split (cached)."""
        if split not in self.scenes:
            found = find_scenes(self.root / split, key=f"data.root ({split} split)")
            self.scenes[split] = [validate_scene(s, self.num_classes, self.ignore_index,
                                                 self.mask_bands) for s in found]
            log.info("%s: %d scenes in %s", split, len(found), self.root / split)
        return self.scenes[split]

    def _grid(self, split: str) -> GridTiles:
        return GridTiles(self.scenes_of(split), self.fp, self.normalizer, q=self.q,
                         tile_size=self.tile_size, class_weights=self.class_weights,
                         ignore_index=self.ignore_index, nodata=self.nodata)

    def train_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        if self.mode == "grid":
            ds = self._grid("train")
            if world > 1:  # sample parallelism: each image's tiles round-robin over ranks
                return DataLoader(ShardedTiles(ds), batch_size=1, num_workers=self.num_workers,
                                  sampler=ShardedImageSampler(ds.groups, rank, world,
                                                              seed=self.seed),
                                  persistent_workers=self.num_workers > 0)
            sampler = ImageGroupedSampler(ds.groups, shuffle=True, seed=self.seed)
            return DataLoader(ds, batch_size=1, sampler=sampler, num_workers=self.num_workers,
                              persistent_workers=self.num_workers > 0)
        aug = build_augment(**(self.augment or {}), seed=self.seed) if self.augment else None
        rnd = RandomTiles(self.scenes_of("train"), self.fp, self.normalizer, core=self.core_size,
                          samples_per_epoch=self.samples, seed=self.seed, transform=aug,
                          class_weights=self.class_weights, ignore_index=self.ignore_index,
                          nodata=self.nodata)
        collate = functools.partial(pad_collate, ignore_index=self.ignore_index)
        sampler = EpochSampler(len(rnd), rank=rank, world=world)
        return DataLoader(rnd, batch_size=self.batch_size, sampler=sampler,
                          collate_fn=collate,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
                          drop_last=False)

    def _rank_world(self) -> tuple[int, int]:
        """This process's rank and the world size (Lightning's, when distributed)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        return int(trainer.global_rank), int(trainer.world_size)

    def val_dataloader(self) -> DataLoader:
        ds = self._grid("val")
        rank, world = self._rank_world()
        if world > 1:  # every tile once over all ranks, pad slots where a rank has fewer
            return DataLoader(ShardedTiles(ds), batch_size=1,
                              sampler=padded_slots(len(ds), rank, world),
                              num_workers=self.num_workers,
                              persistent_workers=self.num_workers > 0)
        return DataLoader(ds, batch_size=1, shuffle=False,
                          num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)
