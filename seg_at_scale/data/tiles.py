"""Datasets of halo tiles read from scenes on disk.

Each sample is one tile: the input window (core + halo, aligned) and a target the size
of the model's output in which only the core carries labels (everything else is the
ignore index), so the loss is computed on core pixels only. ``norm`` is the loss
normaliser: for whole-image grid training it is the *whole image's* pixel weight, so the
tile gradients of one image add up to the whole-image gradient (docs/design.md, "Exact training").

Samplers are separate from datasets (as in torchgeo) and live in
:mod:`seg_at_scale.data.samplers`: :class:`GridTiles` enumerates every tile of every scene,
and the samplers keep one image's tiles together (shuffling images, not tiles) so the
optimiser can step once per image.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.data.scenes import Scene
from seg_at_scale.data.windows import RasterWindows
from seg_at_scale.errors import InputError
from seg_at_scale.io import RasterReader
from seg_at_scale.tiling import Footprint, Tile, make_grid, random_core
from seg_at_scale.tiling.geometry import fill_of

__all__ = ["GridTiles", "RandomTiles", "TileSample", "pad_collate"]

TileSample = dict[str, Any]
#: ``(image, labels, inside mask) -> (image, labels, inside mask)`` (an :class:`Augment`)
Transform = Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, ...]]


class _SceneTiles(Dataset):
    """Shared reading logic: scene readers opened lazily per worker process."""

    def __init__(self, scenes: Sequence[Scene], fp: Footprint, normalizer: Normalizer,
                 class_weights: Sequence[float] | None, ignore_index: int,
                 nodata: float | None, transform: Transform | None) -> None:
        self.scenes, self.fp, self.normalizer = list(scenes), fp, normalizer
        self.ignore_index, self.nodata, self.transform = ignore_index, nodata, transform
        self.class_weights = None if class_weights is None else np.asarray(class_weights)
        self._readers: dict[int, tuple[RasterReader, RasterReader]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_readers": {}}  # worker-safe: reopen in each process

    def _open(self, k: int) -> tuple[RasterReader, RasterReader]:
        if k not in self._readers:
            scene = self.scenes[k]
            if scene.mask is None:
                raise InputError(f"scene '{scene.image}' has no mask; training needs one")
            self._readers[k] = (RasterReader(scene.image, nodata=self.nodata),
                                RasterReader(scene.mask))
        return self._readers[k]

    def image_weight(self, k: int) -> float:
        """Total pixel weight of scene ``k`` (sum of class weights over labelled pixels)."""
        counts = np.asarray(self.scenes[k].class_counts, np.float64)
        w = np.ones_like(counts) if self.class_weights is None else self.class_weights
        return float((counts * w).sum())

    def load(self, k: int, tile: Tile, seed: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Normalised window ``[C, h, w]`` and core-only target ``[h', w']`` for a tile.

        A mask of ``M > 1`` bands (one label band per plane) gives targets ``[M, h', w']``.
        ``seed`` reseeds a transform that can be (``Augment.reseed``) before it is applied.
        """
        image_r, mask_r = self._open(k)
        source = RasterWindows(image_r, self.normalizer, fill_of(self.fp))
        keep: tuple[slice, slice] | np.ndarray  # the inside: slices, a mask once transformed
        x, keep, invalid = source.rescaled(tile.read)
        # labels over the whole input window, ignore outside the core and on no-data
        labels = np.full((mask_r.bands, tile.read.height, tile.read.width), self.ignore_index,
                         np.int64)
        core = tile.core
        lr, lc = core.row - tile.read.row, core.col - tile.read.col
        labels[:, lr : lr + core.height, lc : lc + core.width] = mask_r.read(core)
        if invalid is not None:
            labels[:, invalid] = self.ignore_index
        labels = labels[0] if mask_r.bands == 1 else labels
        if self.transform is not None:  # geometric: image and labels alike; photometric: image
            if seed is not None and hasattr(self.transform, "reseed"):
                self.transform.reseed(seed)
            inside = np.zeros(x.shape[-2:], bool)
            inside[keep] = True  # the fill rule follows the pixels a flip or rotation moves
            x, labels, keep = self.transform(x, labels, inside)
        x = source.finish(x, keep)
        h = self.fp.halo if self.fp.padding == "valid" else 0  # output = window - 2 halo
        target = labels[..., h : labels.shape[-2] - h, h : labels.shape[-1] - h]
        return np.ascontiguousarray(x), np.ascontiguousarray(target, dtype=np.int64)


class GridTiles(_SceneTiles):
    """Every tile of every scene's grid, in order (image by image, row-major).

    ``norm`` is the whole image's pixel weight and ``last`` marks the image's last tile:
    summing ``loss_sum / norm`` over an image's tiles gives the whole-image loss.
    """

    def __init__(self, scenes: Sequence[Scene], fp: Footprint, normalizer: Normalizer, *,
                 q: int | tuple[int, int] | None = None, tile_size: int | None = None,
                 class_weights: Sequence[float] | None = None, ignore_index: int = 255,
                 nodata: float | None = None) -> None:
        super().__init__(scenes, fp, normalizer, class_weights, ignore_index, nodata, None)
        self.items: list[tuple[int, Tile, bool]] = []
        self.groups: list[list[int]] = []
        for k, scene in enumerate(self.scenes):
            with RasterReader(scene.image) as r:
                grid = make_grid(r.height, r.width, fp, q=q, tile_size=tile_size)
            start = len(self.items)
            self.items += [(k, t, i == len(grid) - 1) for i, t in enumerate(grid)]
            self.groups.append(list(range(start, len(self.items))))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> TileSample:
        k, tile, last = self.items[i]
        x, target = self.load(k, tile)
        return {"image": torch.from_numpy(x), "target": torch.from_numpy(target),
                "norm": torch.tensor(self.image_weight(k), dtype=torch.float64),
                "last": torch.tensor(last), "scene": k,
                "core": torch.tensor([tile.core.row, tile.core.col,
                                      tile.core.height, tile.core.width])}


class RandomTiles(_SceneTiles):
    """Random aligned tiles with a ``core x core`` output, reproducible per (seed, index).

    The augmentation too depends on (seed, index) alone, whatever the DataLoader workers.

    Index ``i`` may exceed ``len(self)``: :class:`EpochSampler` hands out fresh indices
    every epoch, so tiles differ between epochs yet every run draws the same ones.

    ``norm`` is the tile's own pixel weight: a batch's loss is its mean over labelled
    core pixels, as in ordinary crop training.
    """

    def __init__(self, scenes: Sequence[Scene], fp: Footprint, normalizer: Normalizer, *,
                 core: int, samples_per_epoch: int, seed: int = 0,
                 transform: Transform | None = None,
                 class_weights: Sequence[float] | None = None, ignore_index: int = 255,
                 nodata: float | None = None) -> None:
        super().__init__(scenes, fp, normalizer, class_weights, ignore_index, nodata, transform)
        self.core, self.samples, self.seed = core, samples_per_epoch, seed
        self.sizes = []
        for scene in self.scenes:
            with RasterReader(scene.image) as r:
                self.sizes.append((r.height, r.width))
        self.weights = np.asarray([h * w for h, w in self.sizes], np.float64)
        self.weights /= self.weights.sum()

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> TileSample:
        rng = np.random.default_rng((self.seed, i))
        k = int(rng.choice(len(self.scenes), p=self.weights))
        tile = random_core(*self.sizes[k], self.fp, self.core, (rng.random(), rng.random()))
        # the augmentation too depends on (seed, i) alone: DataLoader workers each hold a copy
        # of the pipeline, whose shared random state would repeat across workers
        x, target = self.load(k, tile, seed=int(rng.integers(2**31)))
        t = torch.from_numpy(target)
        w = torch.from_numpy(self.class_weights).float()[t.clamp(0, len(self.class_weights) - 1)] \
            if self.class_weights is not None else torch.ones(t.shape)
        norm = (w * (t != self.ignore_index)).sum().double()
        return {"image": torch.from_numpy(x), "target": t, "norm": norm,
                "last": torch.tensor(True), "scene": k}


def pad_collate(samples: list[TileSample], ignore_index: int = 255) -> TileSample:
    """Batch tiles; windows clipped at an image border are padded at the bottom/right.

    Padding keeps the window origin (and so its alignment); padded pixels carry zeros in
    the image and the ignore index in the target, so they add nothing to the loss.
    """
    h = max(s["image"].shape[-2] for s in samples)
    w = max(s["image"].shape[-1] for s in samples)
    th = max(s["target"].shape[-2] for s in samples)
    tw = max(s["target"].shape[-1] for s in samples)
    images = torch.zeros(len(samples), samples[0]["image"].shape[0], h, w)
    lead = tuple(samples[0]["target"].shape[:-2])  # (M,) for multi-band masks
    targets = torch.full((len(samples), *lead, th, tw), ignore_index, dtype=torch.int64)
    for k, s in enumerate(samples):
        x, t = s["image"], s["target"]
        images[k, :, : x.shape[-2], : x.shape[-1]] = x
        targets[k, ..., : t.shape[-2], : t.shape[-1]] = t
    return {"image": images, "target": targets,
            "norm": torch.stack([s["norm"] for s in samples]),
            "last": torch.stack([s["last"] for s in samples]),
            "scene": torch.tensor([s["scene"] for s in samples])}
