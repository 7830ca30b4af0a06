"""Every sampler of tiles: random-tile epochs, whole images, and images shared by ranks.

Samplers yield indices (or slots) into the tile datasets of :mod:`seg_at_scale.data.tiles`;
they never read pixels. One process is the one-rank case of the sharded sampler
(:class:`ImageGroupedSampler`).

Sample parallelism: the tiles of each image spread over the ranks.

Every rank walks the same images in the same (seeded, per-epoch) order and takes the
tiles ``rank, rank + world, ...`` of each image's grid (round-robin). Ranks must take part
in the same number of gradient all-reduces, so a rank with fewer tiles of an image (q^2
not a multiple of the world size, or fewer tiles than ranks) gets *pad* slots: no forward,
no loss, only its place in the image's all-reduce. ``last`` marks each rank's final slot of
an image, where the summed gradient is the whole image's (docs/design.md, "Exact training").

>>> s = ShardedImageSampler([[0, 1, 2, 3, 4]], rank=1, world=2, shuffle=False)
>>> list(s)
[(1, False), (3, False), (-1, True)]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

__all__ = ["EpochSampler", "ImageGroupedSampler", "ShardedImageSampler", "ShardedTiles",
           "ResumableSampler", "shard_indices", "padded_slots", "is_pad"]

PAD = -1


class ShardedImageSampler(Sampler[tuple[int, bool]]):
    """Per-rank slots ``(tile index or -1, last)`` of every image, images shuffled alike.

    Args:
        groups: tile indices of each image (``GridTiles.groups``).
        rank, world: this process's rank and the number of ranks.
        shuffle: shuffle images each epoch (same order on every rank).
        seed: shuffling seed.
    """

    def __init__(self, groups: Sequence[Sequence[int]], rank: int, world: int,
                 shuffle: bool = True, seed: int = 0) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside 0..{world - 1}")
        self.groups, self.rank, self.world = [list(g) for g in groups], rank, world
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def slots(self, group: Sequence[int]) -> list[tuple[int, bool]]:
        """This rank's slots of one image (padded to the busiest rank's count)."""
        mine = list(group[self.rank :: self.world])
        n = -(-len(group) // self.world)
        mine += [PAD] * (n - len(mine))
        return [(i, k == n - 1) for k, i in enumerate(mine)]

    def __iter__(self) -> Iterator[tuple[int, bool]]:
        order = np.arange(len(self.groups))
        if self.shuffle:
            order = np.random.default_rng((self.seed, self.epoch)).permutation(order)
        for g in order:
            yield from self.slots(self.groups[g])

    def __len__(self) -> int:
        return sum(-(-len(g) // self.world) for g in self.groups)


class ImageGroupedSampler(Sampler[int]):
    """One process's walk over whole images: shuffle images, keep each image's tiles in order.

    The one-rank case of :class:`ShardedImageSampler` (one rule for the image order).

    >>> list(ImageGroupedSampler([[0, 1], [2, 3, 4]], shuffle=False))
    [0, 1, 2, 3, 4]
    """

    def __init__(self, groups: Sequence[Sequence[int]], shuffle: bool = True,
                 seed: int = 0) -> None:
        self.sharded = ShardedImageSampler(groups, 0, 1, shuffle=shuffle, seed=seed)

    def set_epoch(self, epoch: int) -> None:
        self.sharded.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return (i for i, _ in self.sharded)

    def __len__(self) -> int:
        return len(self.sharded)


class EpochSampler(Sampler[int]):
    """Indices ``epoch * n ... epoch * n + n - 1`` (Lightning calls ``set_epoch``).

    With ``world > 1`` ranks, rank ``r`` takes every ``world``-th of them from ``r``: the
    ranks together draw the same tiles as one process would.
    """

    def __init__(self, n: int, rank: int = 0, world: int = 1) -> None:
        self.n, self.epoch, self.rank, self.world = n, 0, rank, world

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.epoch * self.n + self.rank, (self.epoch + 1) * self.n,
                          self.world))

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.world))


class ResumableSampler(Sampler[Any]):
    """A training sampler that a resumed run enters part-way into its interrupted epoch.

    A run stopped mid-epoch (SIGTERM, Slurm's requeue) resumes with Lightning's batch
    counter at the batches it had done; without this the epoch would start over and train
    on its first batches twice. :meth:`resume_at` skips them once, in that epoch only;
    the length stays the whole epoch's, which Lightning's counter expects.

    >>> s = ResumableSampler(ImageGroupedSampler([[0, 1], [2, 3, 4]], shuffle=False))
    >>> s.resume_at(epoch=0, batches=2)
    >>> list(s), list(s), len(s)
    ([2, 3, 4], [0, 1, 2, 3, 4], 5)
    """

    def __init__(self, sampler: Any, batch_size: int = 1) -> None:
        self.sampler, self.batch_size = sampler, batch_size
        self.epoch = 0
        self._resume: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.sampler.set_epoch(epoch)

    def resume_at(self, epoch: int, batches: int) -> None:
        """Leave out the first ``batches`` batches of ``epoch`` (done before the stop).

        The epoch is set here too: with data-loader workers, Lightning's first pass of a
        resumed run starts drawing before it sets the sampler's epoch.
        """
        self.set_epoch(epoch)
        self._resume = (epoch, batches) if batches > 0 else None

    def __iter__(self) -> Iterator[Any]:
        items = iter(self.sampler)
        if self._resume is not None and self._resume[0] == self.epoch:
            skip = self._resume[1] * self.batch_size
            self._resume = None
            for _ in range(skip):
                next(items, None)
        return items

    def __len__(self) -> int:
        return len(self.sampler)


class ShardedTiles(Dataset):
    """A grid dataset indexed by ``(index, last)`` slots; ``index = -1`` is a pad slot."""

    def __init__(self, tiles: Dataset) -> None:
        self.tiles = tiles

    def __len__(self) -> int:
        return len(self.tiles)  # type: ignore[arg-type]

    def __getitem__(self, slot: tuple[int, bool]) -> dict[str, Any]:
        i, last = slot
        if i == PAD:
            return {"image": torch.zeros(1, 1, 1), "target": torch.zeros(1, 1, dtype=torch.int64),
                    "norm": torch.tensor(1.0, dtype=torch.float64), "last": torch.tensor(last),
                    "pad": torch.tensor(True)}
        sample = dict(self.tiles[i])
        sample["last"], sample["pad"] = torch.tensor(last), torch.tensor(False)
        return sample


def shard_indices(n: int, rank: int, world: int) -> list[int]:
    """Round-robin share of ``range(n)`` (random-tile epochs)."""
    return list(range(rank, n, world))


def padded_slots(n: int, rank: int, world: int) -> list[tuple[int, bool]]:
    """This rank's ``(index, last)`` slots of ``range(n)``, padded to every rank's count.

    Validation walks every tile once over all ranks; a rank with fewer tiles (``n`` not a
    multiple of ``world``, or fewer tiles than ranks) gets pad slots, so every rank runs
    the same number of steps and reaches the epoch-end metric sync (a rank without a single
    batch would have no loop at all: "DataLoader within local rank has zero length").

    >>> padded_slots(3, rank=1, world=4), padded_slots(3, rank=3, world=4)
    ([(1, True)], [(-1, True)])
    """
    return ShardedImageSampler([list(range(n))], rank, world, shuffle=False).slots(
        list(range(n)))


def is_pad(batch: dict[str, Any]) -> bool:
    """True for a batch of pad slots only (no tile: nothing to compute)."""
    pad = batch.get("pad")
    return pad is not None and bool(pad.all())
