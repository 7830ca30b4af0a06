"""TACO (Trash Annotations in Context) converted to the project's scene layout.

TACO is COCO-style: ``annotations.json`` (``images``, ``annotations`` with polygon
``segmentation``, ``categories`` with ``supercategory``) beside the image folders
(``batch_1/000006.jpg`` ...). Polygons are rasterised with ``pycocotools``; larger objects
are painted first so small ones on top stay visible. Class 0 is background; the others
are the 60 categories (``classes="category"``) or their supercategories
(``classes="supercategory"``), in sorted order::

    TACO_DATASET=/data/taco seg-train experiment=taco_waste

The source folder is ``data.synthetic.options.source`` (default ``$TACO_DATASET``); images
are split into train / val / test by a seeded shuffle. ``data.synthetic.options.classes``
chooses categories or supercategories.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from pycocotools import mask as coco_mask

from seg_at_scale.data.sources.base import Source
from seg_at_scale.data.sources.streets import fit_scene, read_rgb, write_street_scene
from seg_at_scale.errors import ConfigError, InputError

__all__ = ["TacoIndex", "load_taco", "rasterise", "Taco"]

ENV = "TACO_DATASET"


class TacoIndex:
    """The parts of a COCO annotation file the conversion needs.

    Args:
        doc: the parsed ``annotations.json``.
        classes: ``"category"`` or ``"supercategory"``.
        path: the file (for error messages).
    """

    def __init__(self, doc: dict[str, Any], classes: str = "category",
                 path: str = "annotations.json") -> None:
        if classes not in ("category", "supercategory"):
            raise ConfigError(f"TACO classes={classes!r}: use 'category' or 'supercategory'")
        for key in ("images", "annotations", "categories"):
            if key not in doc:
                raise InputError(f"'{path}' has no {key!r} list: not a COCO annotation file")
        cats = sorted(doc["categories"], key=lambda c: c["id"])
        if classes == "category":
            self.class_names = ("background", *(c["name"] for c in cats))
            self.class_of = {c["id"]: k + 1 for k, c in enumerate(cats)}
        else:
            supers = sorted({c["supercategory"] for c in cats})
            self.class_names = ("background", *supers)
            self.class_of = {c["id"]: supers.index(c["supercategory"]) + 1 for c in cats}
        self.images = sorted(doc["images"], key=lambda i: i["id"])
        self.by_image: dict[int, list[dict[str, Any]]] = {i["id"]: [] for i in self.images}
        for ann in doc["annotations"]:
            if ann["image_id"] not in self.by_image:
                raise InputError(f"'{path}': annotation {ann.get('id')} refers to image "
                                 f"{ann['image_id']}, which is not in 'images'")
            if ann["category_id"] not in self.class_of:
                raise InputError(f"'{path}': annotation {ann.get('id')} has category "
                                 f"{ann['category_id']}, which is not in 'categories'")
            self.by_image[ann["image_id"]].append(ann)


def load_taco(source: str | os.PathLike[str], classes: str = "category") -> TacoIndex:
    """Read ``<source>/annotations.json``."""
    path = Path(source) / "annotations.json"
    if not path.exists():
        raise InputError(f"no '{path}'; point ${ENV} at the TACO folder holding "
                         "annotations.json and the image batches")
    return TacoIndex(json.loads(path.read_text()), classes, str(path))


def rasterise(index: TacoIndex, image: dict[str, Any]) -> np.ndarray:
    """Class mask ``[H, W]`` uint8 of one image (0 = background, largest objects first)."""
    h, w = int(image["height"]), int(image["width"])
    out = np.zeros((h, w), np.uint8)
    anns = sorted(index.by_image[image["id"]], key=lambda a: -float(a.get("area", 0.0)))
    for ann in anns:
        seg = ann["segmentation"]
        if isinstance(seg, list):  # polygons [[x0, y0, x1, y1, ...], ...]
            polys = [p for p in seg if len(p) >= 6]
            if not polys:
                continue
            rle = coco_mask.merge(coco_mask.frPyObjects(polys, h, w))
        elif isinstance(seg.get("counts"), list):  # uncompressed RLE (iscrowd)
            rle = coco_mask.frPyObjects(seg, h, w)
        else:
            rle = seg
        out[coco_mask.decode(rle).astype(bool)] = index.class_of[ann["category_id"]]
    return out


class Taco(Source):
    """TACO converted into ``<root>/{train,val,test}`` (data=taco).

    Args:
        splits: images per split, taken in this order from a shuffle seeded by ``seed``.
        height: scale images down (aspect kept) to fit this height; None keeps them.
        width: and this width.
        seed: shuffle seed.
        source: the TACO folder (``annotations.json`` + images); default ``$TACO_DATASET``.
        classes: ``"category"`` (61 classes with background) or ``"supercategory"``.
    """

    name = "taco"
    needs = f"the TACO folder (data.synthetic.options.source or ${ENV})"

    def __init__(self, splits: Mapping[str, int], height: int | None = None,
                 width: int | None = None, seed: int = 0, *,
                 source: str | os.PathLike[str] | None = None,
                 classes: str = "category") -> None:
        super().__init__(splits, height, width, seed)
        source = source or os.environ.get(ENV)
        if not source:
            raise ConfigError(f"data=taco needs {self.needs}: set it to the TACO folder "
                              "holding annotations.json")
        self.source, self.class_mode = Path(source), classes
        self.index = load_taco(source, classes)
        self.classes = tuple(self.index.class_names)  # background, then the (super)categories
        self._images: dict[str, dict[str, Any]] = {}

    def parameters(self) -> dict[str, Any]:
        return {"dataset": "taco", "source": str(self.source.resolve()),
                "classes": self.class_mode, "seed": self.seed, "splits": self.splits,
                "height": self.height, "width": self.width,
                "class_names": list(self.index.class_names)}

    def plan(self) -> dict[str, list[str]]:
        need = sum(self.splits.values())
        if need > len(self.index.images):
            raise ConfigError(f"data.synthetic.splits asks for {need} TACO images but "
                              f"'{self.source}' has {len(self.index.images)}; lower the "
                              "split counts")
        order = np.random.default_rng(self.seed).permutation(len(self.index.images))
        names, start = {}, 0
        for split, count in self.splits.items():
            infos = [self.index.images[int(k)] for k in order[start : start + count]]
            self._images.update({f"taco_{int(i['id']):06d}": i for i in infos})
            names[split] = [f"taco_{int(i['id']):06d}" for i in infos]
            start += count
        return names

    def write(self, folder: Path, name: str, seed: int) -> None:
        info = self._images[name]
        mask = rasterise(self.index, info)
        rgb = read_rgb(self.source / info["file_name"], mask.shape)
        rgb, mask = fit_scene(rgb, mask, self.height, self.width)
        write_street_scene(folder, name, rgb, mask, overwrite=True)
