"""Scenes on disk (an image TIFF and its mask TIFF) and the checks they must pass.

A scene is validated once, streaming over row bands (never the whole image in memory):
readable files, mask size equal to the image size, a single-band mask, label values
below ``num_classes`` (or the ignore index). The class histogram gathered on the way is
what exact whole-image training needs to normalise each tile's loss.

>>> from pathlib import Path
>>> Scene(Path("a_image.tif"), Path("a_mask.tif")).name
'a'
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from seg_at_scale.errors import InputError
from seg_at_scale.io import RasterReader
from seg_at_scale.tiling import Window

__all__ = ["Scene", "find_scenes", "validate_scene", "class_histogram"]

IMAGE_SUFFIX, MASK_SUFFIX = "_image.tif", "_mask.tif"


@dataclass
class Scene:
    """One image and (for training / evaluation) its mask.

    Attributes:
        image: path of the image TIFF ``[C, H, W]``.
        mask: path of the single-band label TIFF ``[H, W]``, or None.
        class_counts: labelled pixels per class, filled by :func:`validate_scene`.
    """

    image: Path
    mask: Path | None = None
    class_counts: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        stem = self.image.name
        return stem[: -len(IMAGE_SUFFIX)] if stem.endswith(IMAGE_SUFFIX) else self.image.stem


def find_scenes(folder: str | os.PathLike[str], *, key: str = "data.root") -> list[Scene]:
    """Scenes ``<name>_image.tif`` + ``<name>_mask.tif`` in ``folder``, sorted by name."""
    root = Path(folder)
    if not root.is_dir():
        raise InputError(f"{key}: folder '{root}' does not exist; point {key} at a folder "
                         f"of <name>{IMAGE_SUFFIX} / <name>{MASK_SUFFIX} pairs")
    scenes = []
    for image in sorted(root.glob(f"*{IMAGE_SUFFIX}")):
        mask = image.with_name(image.name[: -len(IMAGE_SUFFIX)] + MASK_SUFFIX)
        if not mask.exists():
            raise InputError(f"'{image}' has no mask: expected '{mask}' next to it")
        scenes.append(Scene(image, mask))
    if not scenes:
        raise InputError(f"{key}: no '*{IMAGE_SUFFIX}' files in '{root}'")
    return scenes


def class_histogram(mask: RasterReader, num_classes: int, ignore_index: int,
                    band_rows: int = 1024, mask_bands: int = 1) -> list[int]:
    """Pixels per class over the whole mask, read in row bands; checks label values.

    ``mask_bands > 1``: one label band per image plane (e.g. detector wire planes); the
    histogram counts all bands.
    """
    if mask.bands != mask_bands:
        if mask_bands == 1:
            raise InputError(f"mask '{mask.path}' has {mask.bands} bands; masks are "
                             "single-band label images (one class id per pixel), or set "
                             "data.mask_bands for one label band per plane (data.mask_bands=1 "
                             "now)")
        raise InputError(f"mask '{mask.path}' has {mask.bands} bands but data.mask_bands="
                         f"{mask_bands}; give one label band per plane or fix data.mask_bands")
    if np.issubdtype(mask.dtype, np.floating):
        raise InputError(f"mask '{mask.path}' has float samples ({mask.dtype}); store class "
                         "ids as an integer type (uint8 for up to 255 classes)")
    counts = np.zeros(max(num_classes, ignore_index + 1), np.int64)
    for r0 in range(0, mask.height, band_rows):
        h = min(band_rows, mask.height - r0)
        labels = mask.read(Window(r0, 0, h, mask.width))
        bad = (labels >= num_classes) & (labels != ignore_index)
        if bad.any():
            b, r, c = np.argwhere(bad)[0]
            labels = labels[b]
            raise InputError(
                f"mask '{mask.path}' has label {int(labels[r, c])} at row {r0 + r}, col {c}, "
                f"but data.num_classes={num_classes} (valid labels 0..{num_classes - 1}, "
                f"{ignore_index} = ignore); fix the mask or raise data.num_classes")
        counts += np.bincount(labels.ravel().astype(np.int64), minlength=counts.size)[
            : counts.size]
    return [int(v) for v in counts[:num_classes]]


def validate_scene(scene: Scene, num_classes: int, ignore_index: int = 255,
                   mask_bands: int = 1) -> Scene:
    """Open and check a scene; fill ``scene.class_counts``. Raises :class:`InputError`."""
    with RasterReader(scene.image) as image:
        if scene.mask is None:
            return scene
        with RasterReader(scene.mask) as mask:
            if (mask.height, mask.width) != (image.height, image.width):
                raise InputError(
                    f"mask '{scene.mask}' is {mask.height}x{mask.width} but image "
                    f"'{scene.image}' is {image.height}x{image.width}; masks must cover the "
                    "image pixel for pixel")
            scene.class_counts = class_histogram(mask, num_classes, ignore_index,
                                                 mask_bands=mask_bands)
    return scene
