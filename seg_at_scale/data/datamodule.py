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
from typing import Any, cast

import pytorch_lightning as pl
from torch.utils.data import DataLoader

from seg_at_scale.data.config import AUTO, DataConfig, TilingConfig, data_config, tiling_config
from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.data.samplers import (
    EpochSampler,
    ImageGroupedSampler,
    ResumableSampler,
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
    """Halo tiles of the scenes under ``data.root/<split>/``.

    The ``data`` config group is this class's config: ``conf/data/*.yaml`` names it as its
    ``_target_``, so the training command builds it with ``instantiate(cfg.data,
    _partial_=True, _convert_="all")(tiling=..., footprint=..., seed=..., scenes=...)``.
    Its keys are the ``data`` keys of
    :class:`~seg_at_scale.data.config.DataConfig`, validated here (unknown keys refused by
    name); ``scale`` / ``mean`` / ``std`` must be numbers by now (``auto`` is resolved
    before, :func:`seg_at_scale.cli.data_setup.resolve_normalization`).

    Args:
        tiling: the ``tiling`` group (:class:`~seg_at_scale.data.config.TilingConfig`):
            ``grid`` mode walks every tile of every image's grid (exact whole-image
            gradient), ``random`` draws aligned tiles in batches; validation always walks
            the grid.
        footprint: the model's footprint (halo, alignment, padding).
        seed: sampling and augmentation seed.
        scenes: scenes already validated per split (:func:`~seg_at_scale.data.preflight.
            preflight`), so their files are not read again; other splits are validated when
            first used.
        data: the ``data`` group as a :class:`~seg_at_scale.data.config.DataConfig`, in
            place of its keys.
        **keys: the ``data`` group's keys.
    """

    def __init__(self, tiling: TilingConfig | Mapping[str, Any], footprint: Footprint, *,
                 seed: int = 0, scenes: Mapping[str, list[Scene]] | None = None,
                 data: DataConfig | None = None, **keys: Any) -> None:
        super().__init__()
        if (data is None) == (not keys):
            raise TypeError("TileDataModule takes the data group's keys or data=DataConfig")
        self.data = data if data is not None else data_config(keys)
        self.tiling = tiling if isinstance(tiling, TilingConfig) else tiling_config(tiling)
        d = self.data
        unresolved = [k for k in ("scale", "mean", "std") if getattr(d, k) == AUTO]
        if unresolved:
            raise ConfigError(f"data.{unresolved[0]}=auto is worked out from the training "
                              "split before the DataModule is built (seg-train does it); "
                              f"give data.{unresolved[0]} as numbers here")
        self.fp = footprint
        mean, std = cast(Sequence[float], d.mean), cast(Sequence[float], d.std)  # not auto
        self.normalizer = Normalizer(float(d.scale), tuple(mean), tuple(std))
        self.class_weights = None if d.class_weights is None else list(d.class_weights)
        self.seed = seed
        self.scenes: dict[str, list[Scene]] = dict(scenes or {})

    def optimizer_steps_per_epoch(self) -> int:
        """Optimiser steps in one epoch: one per training image (grid), else one per batch.

        Random tiles: the batches the trainer runs (``limit_train_batches``, gradient
        accumulation). Counted from a loader of their own, not through the trainer's
        (``estimated_stepping_batches`` makes the trainer's loader before a resumed run's
        loops are restored, and its sampler started the resumed epoch at epoch 0).
        """
        trainer = getattr(self, "trainer", None)
        limit = getattr(trainer, "limit_train_batches", None)
        if self.tiling.mode == "grid":
            return self.whole_images_per_epoch(limit)
        batches = len(self.train_dataloader())
        if isinstance(limit, int) and not isinstance(limit, bool):
            batches = min(batches, limit)
        elif isinstance(limit, float):
            batches = int(batches * limit)
        accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        return max(1, -(-batches // accumulate))

    def whole_images_per_epoch(self, limit: object, world: int | None = None) -> int:
        """Grid training's optimiser steps in one epoch: the whole images its batches finish.

        Args:
            limit: ``trainer.limit_train_batches`` (a count, a fraction, or None).
            world: processes sharing each image's tiles (default: the trainer's).

        Raises:
            ConfigError: a limit below one image's tiles on a rank, which would end every
                epoch before any step (a grid step comes once an image's last tile is done).
        """
        groups = self._grid("train").groups
        world = world or self._rank_world()[1]
        per_rank = [-(-len(g) // world) for g in groups]
        batches = sum(per_rank)
        if isinstance(limit, float):
            limit = int(batches * limit)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit >= batches:
            return len(groups)
        fewest = min(per_rank)
        if limit < fewest:
            raise ConfigError(
                f"trainer.limit_train_batches={limit} ends each epoch before an image's "
                f"{fewest} grid tiles, and grid training steps once per whole image: no step "
                f"would be taken; give trainer.limit_train_batches >= {fewest} (a multiple of "
                f"it: whole images), or train on random tiles (tiling=random)")
        return max(1, min(len(groups), limit // max(per_rank)))

    def scenes_of(self, split: str) -> list[Scene]:
        """Validated scenes of a split (cached)."""
        if split not in self.scenes:
            folder = Path(self.data.root) / split
            found = find_scenes(folder, key=f"data.root ({split} split)")
            self.scenes[split] = [validate_scene(s, self.data.num_classes,
                                                 self.data.ignore_index, self.data.mask_bands)
                                  for s in found]
            log.info("%s: %d scenes in %s", split, len(found), folder)
        return self.scenes[split]

    def _grid(self, split: str) -> GridTiles:
        t = self.tiling
        return GridTiles(self.scenes_of(split), self.fp, self.normalizer, q=t.q,
                         # tile_size=auto is measured before (cli.training.resolve_auto_tile)
                         tile_size=cast(int | None, t.tile_size),
                         class_weights=self.class_weights,
                         ignore_index=self.data.ignore_index, nodata=self.data.nodata)

    def train_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        workers = self.data.num_workers
        if self.tiling.mode == "grid":
            ds = self._grid("train")
            if world > 1:  # sample parallelism: each image's tiles round-robin over ranks
                return DataLoader(ShardedTiles(ds), batch_size=1, num_workers=workers,
                                  sampler=self._resumable(ShardedImageSampler(
                                      ds.groups, rank, world, seed=self.seed)),
                                  persistent_workers=workers > 0)
            grouped = ImageGroupedSampler(ds.groups, shuffle=True, seed=self.seed)
            return DataLoader(ds, batch_size=1, sampler=self._resumable(grouped),
                              num_workers=workers, persistent_workers=workers > 0)
        t, d = self.tiling, self.data
        aug = build_augment(**dict(t.augment), seed=self.seed) if t.augment else None
        if t.samples_per_epoch is None or t.core_size is None:
            raise ConfigError("tiling.mode=random needs tiling.core_size and "
                              "tiling.samples_per_epoch (see conf/tiling/random.yaml)")
        rnd = RandomTiles(self.scenes_of("train"), self.fp, self.normalizer,
                          core=t.core_size,
                          samples_per_epoch=t.samples_per_epoch, seed=self.seed, transform=aug,
                          class_weights=self.class_weights, ignore_index=d.ignore_index,
                          nodata=d.nodata)
        collate = functools.partial(pad_collate, ignore_index=d.ignore_index)
        sampler = self._resumable(EpochSampler(len(rnd), rank=rank, world=world), t.batch_size)
        return DataLoader(rnd, batch_size=t.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=workers, persistent_workers=workers > 0, drop_last=False)

    def _resumable(self, sampler: Any, batch_size: int = 1) -> ResumableSampler:
        """``sampler`` entering the interrupted epoch where a resumed run stopped.

        Lightning restores its loops before it asks for the training data: a checkpoint
        written mid-epoch (a stop by SIGTERM, Ctrl+C or Slurm's requeue) leaves
        ``batch_progress`` at the batches done, which the first pass then leaves out.
        """
        out = ResumableSampler(sampler, batch_size)
        trainer = getattr(self, "trainer", None)
        loop = getattr(trainer, "fit_loop", None)
        if trainer is None or loop is None:
            return out
        # the epoch Lightning runs first, set now: with workers, the first batches are
        # drawn before Lightning sets it, and a run resumed from an epoch's last.ckpt (what
        # a killed run resumes from) trained on epoch 0's tiles again
        epoch = int(loop.epoch_progress.current.processed)
        done = int(loop.epoch_loop.batch_progress.current.completed)
        if loop.restarting and 0 < done < -(-len(out) // batch_size):  # inside the epoch
            out.resume_at(epoch, done)
            log.info("resuming epoch %d after its first %d batches", epoch, done)
        else:
            out.resume_at(epoch, 0)
        return out

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
                              num_workers=self.data.num_workers,
                              persistent_workers=self.data.num_workers > 0)
        return DataLoader(ds, batch_size=1, shuffle=False, num_workers=self.data.num_workers,
                          persistent_workers=self.data.num_workers > 0)
