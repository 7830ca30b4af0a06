"""Augmentations (albumentations) applied identically to an image window and its labels.

Only transforms that keep a halo window's geometry are offered: flips and 90-degree
rotations map the window's centre region (the model output) onto itself, so the core
labels stay aligned with the output. Photometric transforms act on the image only, on
samples rescaled to ``[0, 1]`` before standardisation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# albumentations asks PyPI for a newer release on import (2 s timeout), in every process
# that imports it: nothing here goes online unasked (NO_ALBUMENTATIONS_UPDATE=0 re-enables)
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

import albumentations as A  # noqa: E402
import numpy as np  # noqa: E402

__all__ = ["Augment", "build_augment"]


@dataclass
class Augment:
    """Callable ``(image [C, h, w] float32, labels [h, w] or [M, h, w]) -> same shapes``.

    Labels of ``M`` planes (one label band per detector plane) move with the image alike.
    """

    pipeline: A.Compose

    def reseed(self, seed: int) -> None:
        """Restart the random draws from ``seed``.

        A per-sample seed makes a sample's augmentation independent of DataLoader workers
        and of the order in which samples are drawn.
        """
        self.pipeline.set_random_seed(seed)

    def __call__(self, image: np.ndarray, labels: np.ndarray, *masks: np.ndarray
                 ) -> tuple[np.ndarray, ...]:
        """Transform ``image``, ``labels`` and any extra ``[h, w]`` masks alike.

        Returns ``(image, labels, *masks)``; an extra mask (e.g. which pixels lie inside
        the scene) moves with the geometric transforms and is untouched by the others.
        """
        extra = {"masks": [np.ascontiguousarray(m, np.uint8) for m in masks]} if masks else {}
        planes = labels.ndim == 3  # albumentations takes a mask's planes last, as the image's
        out = self.pipeline(image=np.ascontiguousarray(image.transpose(1, 2, 0)),
                            mask=np.ascontiguousarray(labels.transpose(1, 2, 0)) if planes
                            else labels, **extra)
        moved = tuple(np.asarray(m).astype(masks[i].dtype) for i, m in
                      enumerate(out["masks"])) if masks else ()
        mask = np.asarray(out["mask"]).astype(labels.dtype, copy=False)  # cv2 may give int32
        return (np.ascontiguousarray(out["image"].transpose(2, 0, 1)),
                np.ascontiguousarray(mask.transpose(2, 0, 1)) if planes else mask, *moved)


def build_augment(flips: bool = True, rotate90: bool = True, brightness: float = 0.1,
                  contrast: float = 0.1, noise_std: float = 0.0, p: float = 0.5,
                  seed: int | None = None) -> Augment | None:
    """An :class:`Augment`, or None when every transform is off.

    Args:
        flips: horizontal and vertical flips.
        rotate90: random multiples of 90 degrees (square windows keep their shape).
        brightness: brightness jitter limit (0 = off).
        contrast: contrast jitter limit (0 = off).
        noise_std: standard deviation of additive Gaussian noise on ``[0, 1]`` data.
        p: probability of each transform.
        seed: albumentations seed (reproducible augmentation).
    """
    ts: list[A.BasicTransform] = []
    if flips:
        ts += [A.HorizontalFlip(p=p), A.VerticalFlip(p=p)]
    if rotate90:
        ts.append(A.RandomRotate90(p=p))
    if brightness or contrast:
        ts.append(A.RandomBrightnessContrast(brightness, contrast, p=p))
    if noise_std:
        ts.append(A.GaussNoise(std_range=(noise_std, noise_std), p=p))
    if not ts:
        return None
    return Augment(A.Compose(ts, seed=seed))
