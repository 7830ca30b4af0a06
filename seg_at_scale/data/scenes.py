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
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from seg_at_scale.errors import InputError
from seg_at_scale.io import RasterReader
from seg_at_scale.tiling import Window

__all__ = ["Scene", "find_scenes", "scene_images", "mask_beside", "paired_name", "tiff_of",
           "validate_scene",
           "class_histogram",
           "check_mask_header", "check_mask_covers",
           "label_counts", "check_labels", "stream_rows"]

IMAGE_SUFFIX, MASK_SUFFIX = "_image.tif", "_mask.tif"
LAYOUTS = (f"<name>{IMAGE_SUFFIX} with <name>{MASK_SUFFIX} beside it, or images/<name>.tif "
           "with masks/<name>.tif (.tif or .tiff, in any case)")
#: ``<name>_image.tif`` of the paired layout: ``.tif`` or ``.tiff``, in any case (GIS tools
#: and Windows write ``.TIF``).
_PAIRED = re.compile(r"(?P<name>.+)_image(?P<ext>\.tiff?)", re.IGNORECASE)
_MASK = re.compile(r"(?P<name>.+)_mask(?P<ext>\.tiff?)", re.IGNORECASE)
_TIFF_EXTENSIONS = (".tif", ".tiff", ".TIF", ".TIFF")


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
        return paired_name(self.image) or self.image.stem


def find_scenes(folder: str | os.PathLike[str], *, key: str = "data.root") -> list[Scene]:
    """The scenes of ``folder``, sorted by name, in either layout (:func:`scene_images`).

    Every image must have its mask.
    """
    root = Path(folder)
    if not root.is_dir():
        raise InputError(f"{key}: folder '{root}' does not exist; point {key} at a folder "
                         f"of scenes ({LAYOUTS})")
    scenes: list[Scene] = []
    named: dict[str, Path] = {}
    for image in scene_images(root, key=key) or []:
        mask = (mask_beside(image) if image.parent == root else
                tiff_of(root / "masks" / image.name))
        if not mask.exists():
            raise InputError(f"'{image}' has no mask: expected '{mask}'; every scene of a "
                             "split is scored against its mask: add it, or move the image out "
                             "(scenes without masks: predict them with seg-predict; for a "
                             "test split of them, predict_after_fit=false)")
        scenes.append(Scene(image, mask))
        if (other := named.setdefault(scenes[-1].name, image)) != image:
            raise InputError(f"{key}: '{other}' and '{image}' are both scene "
                             f"'{scenes[-1].name}' (its metrics, its prediction); keep one "
                             "of them in the folder")
    if not scenes:
        raise InputError(f"{key}: no scenes in '{root}'; give {LAYOUTS}")
    _check_masks_have_images(root, {s.mask.resolve() for s in scenes if s.mask is not None})
    return scenes


def _check_masks_have_images(root: Path, used: set[Path]) -> None:
    """Refuse a mask whose image is missing: a misnamed image left out of training unseen."""
    beside = [p for p in root.iterdir() if _MASK.fullmatch(p.name) and p.is_file()]
    masks = root / "masks"
    listed = [p for p in masks.iterdir() if p.suffix.lower() in (".tif", ".tiff")
              and not p.name.startswith(".") and p.is_file()] if masks.is_dir() else []
    for mask in sorted([*beside, *listed]):
        if mask.resolve() in used:
            continue
        if mask.parent == root:
            found = _MASK.fullmatch(mask.name)
            assert found is not None
            image = mask.with_name(f"{found['name']}_image{found['ext']}")
        else:
            image = root / "images" / mask.name
        raise InputError(f"mask '{mask}' has no image: expected '{image}'; name its image so, "
                         "or remove the mask (its scene would be left out of training)")


def paired_name(path: Path) -> str | None:
    """``<name>`` of ``<name>_image.tif`` (``.tiff``, any case); None for any other file."""
    found = _PAIRED.fullmatch(path.name)
    return found["name"] if found else None


def mask_beside(image: Path) -> Path:
    """The mask of ``<name>_image.tif``: ``<name>_mask.tif`` beside it.

    With the image's extension (``a_image.TIF``: ``a_mask.TIF``), else the first of
    ``.tif``, ``.tiff`` (any case) that exists; the first when none does.
    """
    found = _PAIRED.fullmatch(image.name)
    if found is None:
        raise ValueError(f"mask_beside: '{image}' is not named <name>_image.tif")
    return tiff_of(image.with_name(f"{found['name']}_mask{found['ext']}"))


def tiff_of(path: Path) -> Path:
    """``path``, or the file beside it of the same stem and another TIFF extension.

    ``.tif`` or ``.tiff`` in any case: ``tiff_of(Path("masks/a.tif"))`` finds
    ``masks/a.TIFF``; ``path`` itself when none exists.
    """
    if path.exists():
        return path
    others = (path.with_suffix(ext) for ext in _TIFF_EXTENSIONS if ext != path.suffix)
    return next((p for p in others if p.exists()), path)


def scene_images(folder: Path, *, key: str = "data.root") -> list[Path] | None:
    """The images of a folder of scenes, sorted by name; None when it holds neither layout.

    ``<name>_image.tif`` (its mask ``<name>_mask.tif`` beside it), or ``images/<name>.tif``
    (or ``.tiff``; its mask ``masks/<name>.tif``, the same file name). A folder holding
    both is refused: which scenes it means is the user's to say. A scene's name
    (:attr:`Scene.name`) is ``<name>`` in both.
    """
    paired = sorted(p for p in folder.iterdir() if paired_name(p) is not None
                    and not p.name.startswith(".") and not p.is_dir())
    images = folder / "images"
    listed = sorted(p for p in images.iterdir() if p.suffix.lower() in (".tif", ".tiff")
                    and not p.name.startswith(".")) if images.is_dir() else []
    if paired and listed:
        raise InputError(f"{key}: '{folder}' holds scenes in both layouts ('{paired[0].name}' "
                         f"and 'images/{listed[0].name}'); keep one of them in the folder")
    return paired or listed or None


def check_mask_header(mask: RasterReader, mask_bands: int = 1) -> None:
    """Refuse a mask with the wrong band count or float samples (from its header)."""
    if mask.bands != mask_bands:
        if mask_bands == 1:
            colour = " (a colour mask: one class id per colour)" if mask.bands in (3, 4) \
                else ""
            raise InputError(f"mask '{mask.path}' has {mask.bands} bands; masks are "
                             "single-band label images, one class id 0..K-1 per pixel: write "
                             f"its labels as one band of class ids{colour}. Labels of each "
                             "plane of a multi-plane image are data.mask_bands' (data=cosmic "
                             "sets it; data.mask_bands=1 now)")
        raise InputError(f"mask '{mask.path}' has {mask.bands} bands but data.mask_bands="
                         f"{mask_bands}; give one label band per plane or fix data.mask_bands")
    if np.issubdtype(mask.dtype, np.floating):
        raise InputError(f"mask '{mask.path}' has float samples ({mask.dtype}); store class "
                         "ids as an integer type (uint8 for up to 255 classes)")


def stream_rows(reader: RasterReader, rows: int = 1024, budget: int = 1 << 29) -> int:
    """Rows per band for a pass over a whole file: whole compressed strips if they fit.

    A compressed strip is decoded whole by every band that touches it, so bands follow the
    strips (up to ``budget`` bytes); tiles and memory-mapped strips take ``rows``.
    """
    if reader.layout.contiguous is not None:
        return rows  # memory-mapped: any rows cost the same
    seg_rows = reader.layout.seg[0]
    if seg_rows <= rows:
        return rows // seg_rows * seg_rows  # whole segments per band
    row_bytes = reader.width * reader.bands * reader.dtype.itemsize
    return seg_rows if seg_rows * row_bytes <= budget else rows


def label_counts(mask: RasterReader, band_rows: int | None = None) -> dict[int, int]:
    """Pixels per label value over all bands of a mask, read in row bands."""
    step = band_rows or stream_rows(mask)
    counts = np.zeros(0, np.int64)
    for r0 in range(0, mask.height, step):
        labels = mask.read(Window(r0, 0, min(step, mask.height - r0), mask.width))
        if labels.size and labels.min() < 0:
            raise InputError(f"mask '{mask.path}' has negative label {int(labels.min())}; "
                             "labels are class ids >= 0: write unlabelled pixels as "
                             "data.ignore_index (255 by default)")
        more = np.bincount(labels.ravel().astype(np.int64))
        if more.size > counts.size:
            counts = np.pad(counts, (0, more.size - counts.size))
        counts[: more.size] += more
    return {int(v): int(n) for v, n in enumerate(counts) if n}


def check_labels(mask: RasterReader, counts: dict[int, int], num_classes: int,
                 ignore_index: int, *, model: bool = False) -> list[int]:
    """Pixels per class ``0..num_classes-1``; refuses labels outside them (not ignore).

    ``model``: the classes are a trained model's (a truth to score it against), which no
    key of the command changes; else they are ``data.num_classes``, which the user sets.
    """
    bad = sorted(v for v in counts if v >= num_classes and v != ignore_index)
    if bad:
        value = bad[0]
        r, c = _first_pixel(mask, value)
        classes, fix = ((f"the model predicts {num_classes} classes", "give the truth of "
                         "this model's classes, or drop mask=") if model else
                        (f"data.num_classes={num_classes}", "fix the mask or raise "
                         "data.num_classes"))
        raise InputError(
            f"mask '{mask.path}' has label {value} at row {r}, col {c}, but {classes} (valid "
            f"labels 0..{num_classes - 1}, {ignore_index} = ignore; {counts[value]} pixels "
            f"carry it); {fix}")
    return [counts.get(k, 0) for k in range(num_classes)]


def _first_pixel(mask: RasterReader, value: int) -> tuple[int, int]:
    """Row and column of the first pixel holding ``value`` (any band)."""
    step = stream_rows(mask)
    for r0 in range(0, mask.height, step):
        hits = np.argwhere(mask.read(Window(r0, 0, min(step, mask.height - r0),
                                            mask.width)) == value)
        if hits.size:
            return r0 + int(hits[0][1]), int(hits[0][2])
    return -1, -1


def class_histogram(mask: RasterReader, num_classes: int, ignore_index: int,
                    band_rows: int | None = None, mask_bands: int = 1, *,
                    model: bool = False) -> list[int]:
    """Pixels per class over the whole mask, read in row bands; checks label values.

    ``mask_bands > 1``: one label band per image plane (e.g. detector wire planes); the
    histogram counts all bands. ``model``: see :func:`check_labels`.
    """
    check_mask_header(mask, mask_bands)
    return check_labels(mask, label_counts(mask, band_rows), num_classes, ignore_index,
                        model=model)


def check_mask_covers(mask: RasterReader, image: RasterReader) -> None:
    """Refuse a mask whose size differs from its image's, naming both files."""
    if (mask.height, mask.width) != (image.height, image.width):
        raise InputError(f"mask '{mask.path}' is {mask.height}x{mask.width} but image "
                         f"'{image.path}' is {image.height}x{image.width}; masks must cover "
                         "the image pixel for pixel (give the mask of this image)")


def validate_scene(scene: Scene, num_classes: int, ignore_index: int = 255,
                   mask_bands: int = 1) -> Scene:
    """Open and check a scene; fill ``scene.class_counts``. Raises :class:`InputError`."""
    with RasterReader(scene.image) as image:
        if scene.mask is None:
            return scene
        with RasterReader(scene.mask) as mask:
            check_mask_covers(mask, image)
            scene.class_counts = class_histogram(mask, num_classes, ignore_index,
                                                 mask_bands=mask_bands)
    return scene
