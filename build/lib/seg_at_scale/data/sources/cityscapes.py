"""Cityscapes (``leftImg8bit/`` + ``gtFine/``) converted to the project's scene layout.

Images ``leftImg8bit/<split>/<city>/<stem>_leftImg8bit.png`` and labels
``gtFine/<split>/<city>/<stem>_gtFine_labelIds.png`` become
``<root>/<split>/<stem>_image.tif`` (R, G, B, Canny) and ``<stem>_mask.tif`` with the 19
train ids (255 = ignore), mapped with the label table of ``cityscapesscripts``::

    CITYSCAPES_DATASET=/data/cityscapes seg-train experiment=gscnn_cityscapes

The source folder is ``data.synthetic.options.source``, by default ``$CITYSCAPES_DATASET``
(the cityscapesscripts convention).
Cityscapes' own test labels are withheld, so the project's ``test`` split is read from
Cityscapes ``val``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import cv2
import numpy as np
from cityscapesscripts.helpers.labels import labels as CS_LABELS

from seg_at_scale.data.sources.base import Source
from seg_at_scale.data.sources.streets import fit_scene, read_rgb, write_street_scene
from seg_at_scale.errors import ConfigError, InputError

__all__ = ["CITYSCAPES_CLASSES", "label_lut", "find_pairs", "read_pair", "Cityscapes"]

CITYSCAPES_CLASSES = tuple(lab.name for lab in sorted(
    (lab for lab in CS_LABELS if 0 <= lab.trainId < 255), key=lambda lab: lab.trainId))
SOURCE_SPLIT = {"train": "train", "val": "val", "test": "val"}
ENV = "CITYSCAPES_DATASET"


def label_lut() -> np.ndarray:
    """``lut[label id] = train id`` for ids 0..255; ignored and unknown ids map to 255."""
    lut = np.full(256, 255, np.uint8)
    for label in CS_LABELS:
        if 0 <= label.id < 256 and 0 <= label.trainId < 255:
            lut[label.id] = label.trainId
    return lut


def find_pairs(source: str | os.PathLike[str], split: str) -> list[tuple[str, Path, Path]]:
    """``(stem, image, label)`` of a Cityscapes split, sorted by city then stem."""
    src = Path(source)
    images = sorted((src / "leftImg8bit" / split).glob("*/*_leftImg8bit.png"))
    if not images:
        raise InputError(f"no '*_leftImg8bit.png' under '{src / 'leftImg8bit' / split}/<city>/'; "
                         f"point ${ENV} at the folder holding leftImg8bit/ and gtFine/")
    pairs = []
    for img in images:
        stem = img.name[: -len("_leftImg8bit.png")]
        label = src / "gtFine" / split / img.parent.name / f"{stem}_gtFine_labelIds.png"
        if not label.exists():
            raise InputError(f"'{img}' has no label: expected '{label}' (gtFine labelIds)")
        pairs.append((stem, img, label))
    return pairs


def read_pair(image: Path, label: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(rgb [3, H, W] uint8, train ids [H, W] uint8)`` of one Cityscapes image."""
    ids = cv2.imread(str(label), cv2.IMREAD_UNCHANGED)
    if ids is None or ids.ndim != 2:
        raise InputError(f"'{label}' is not a single-channel label id PNG")
    rgb = read_rgb(image, ids.shape)
    return rgb, label_lut()[ids.astype(np.int64).clip(0, 255)]


class Cityscapes(Source):
    """Cityscapes converted into ``<root>/{train,val,test}`` (data=cityscapes).

    Args:
        splits: images per project split (``train``, ``val``, ``test``; 0 = all).
        height: scale each image down (aspect kept) to fit this height; None keeps 1024.
        width: and this width; None keeps 2048.
        seed: unused (the conversion is deterministic).
        source: the Cityscapes folder (``leftImg8bit/``, ``gtFine/``); default
            ``$CITYSCAPES_DATASET``.
    """

    name = "cityscapes"
    needs = f"the Cityscapes folder (data.synthetic.options.source or ${ENV})"
    classes = CITYSCAPES_CLASSES

    def __init__(self, splits: Mapping[str, int], height: int | None = None,
                 width: int | None = None, seed: int = 0, *,
                 source: str | os.PathLike[str] | None = None) -> None:
        super().__init__(splits, height, width, seed)
        source = source or os.environ.get(ENV)
        if not source:
            raise ConfigError(f"data=cityscapes needs {self.needs}: set it to the folder "
                              "holding leftImg8bit/ and gtFine/")
        for split in self.splits:
            if split not in SOURCE_SPLIT:
                raise ConfigError(f"data.synthetic.splits has {split!r}; use train, val, test")
        self.source = Path(source)
        self._pairs: dict[str, tuple[Path, Path]] = {}

    def parameters(self) -> dict[str, Any]:
        return {"dataset": "cityscapes", "source": str(self.source.resolve()),
                "splits": self.splits, "height": self.height, "width": self.width,
                "classes": list(CITYSCAPES_CLASSES)}

    def plan(self) -> dict[str, list[str]]:
        names = {}
        for split, count in self.splits.items():
            pairs = find_pairs(self.source, SOURCE_SPLIT[split])[: count or None]
            self._pairs.update({stem: (img, lbl) for stem, img, lbl in pairs})
            names[split] = [stem for stem, _, _ in pairs]
        return names

    def write(self, folder: Path, name: str, seed: int) -> None:
        rgb, mask = fit_scene(*read_pair(*self._pairs[name]), self.height, self.width)
        write_street_scene(folder, name, rgb, mask, overwrite=True)
