"""Tiny inputs in the real formats of the converted sources: a Cityscapes tree, a TACO
folder (COCO JSON + images), larcv3 HDF5 events. Shared by the source tests."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import h5py
import numpy as np

from seg_at_scale.data.sources.cosmic import IMAGE_GROUP, LABEL_GROUP

# label id -> train id, by hand from the Cityscapes label table (ids 0, 4 are ignored)
CS_EXPECTED = {0: 255, 4: 255, 7: 0, 8: 1, 11: 2, 21: 8, 23: 10, 24: 11, 26: 13, 33: 18}


def write_cityscapes(root: Path, split: str, city: str, n: int, seed: int = 0,
                     size: tuple[int, int] = (44, 60)) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Tiny Cityscapes tree: ``leftImg8bit/<split>/<city>/*`` + ``gtFine/.../*_labelIds.png``."""
    rng = np.random.default_rng(seed)
    out = {}
    for k in range(n):
        stem = f"{city}_{k:06d}_000019"
        rgb = rng.integers(0, 255, (3, *size), dtype=np.uint8)
        ids = rng.choice(list(CS_EXPECTED), size=size).astype(np.uint8)
        img_dir, lbl_dir = root / "leftImg8bit" / split / city, root / "gtFine" / split / city
        img_dir.mkdir(parents=True, exist_ok=True)
        lbl_dir.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(img_dir / f"{stem}_leftImg8bit.png"), rgb.transpose(1, 2, 0)[..., ::-1])
        cv2.imwrite(str(lbl_dir / f"{stem}_gtFine_labelIds.png"), ids)
        out[stem] = (rgb, ids)
    return out


def write_taco(root: Path) -> None:
    """Tiny TACO folder: two PNG photos and a COCO ``annotations.json`` with polygons."""
    rng = np.random.default_rng(1)
    (root / "batch_1").mkdir(parents=True)
    for k in (1, 2):
        img = rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)
        cv2.imwrite(str(root / "batch_1" / f"{k:06d}.png"), img)
    rect = [4, 4, 40, 4, 40, 30, 4, 30]
    doc = {
        "images": [{"id": 1, "file_name": "batch_1/000001.png", "width": 64, "height": 48},
                   {"id": 2, "file_name": "batch_1/000002.png", "width": 64, "height": 48}],
        "categories": [{"id": 7, "name": "Plastic bottle", "supercategory": "Bottle"},
                       {"id": 0, "name": "Bottle cap", "supercategory": "Bottle cap"},
                       {"id": 5, "name": "Glass bottle", "supercategory": "Bottle"}],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 0, "area": 36.0, "iscrowd": 0,
             "segmentation": [[10, 10, 16, 10, 16, 16, 10, 16]]},
            {"id": 2, "image_id": 1, "category_id": 5, "area": 936.0, "iscrowd": 0,
             "segmentation": [rect]},
            {"id": 3, "image_id": 2, "category_id": 7, "area": 300.0, "iscrowd": 0,
             "segmentation": [[30, 5, 60, 5, 60, 15, 30, 15], [2, 30, 12, 30, 12, 40]]},
        ],
    }
    (root / "annotations.json").write_text(json.dumps(doc))


# ----- synthetic streets ----------------------------------------------------------------


# ----- tiny larcv3 files in the real layout ------------------------------------------------

META = np.dtype([("valid", "u1"), ("projection_id", "<u8"), ("image_sizes", "<f8", (2,)),
                 ("number_of_voxels", "<u8", (2,)), ("origin", "<f8", (2,))])
EXT = np.dtype([("first", "<u8"), ("N", "<u4")])
VEXT = np.dtype([("first", "<u8"), ("N", "<u4"), ("ID", "<u4")])
VOX = np.dtype([("id", "<u8"), ("value", "<f4")])


def write_larcv(path: Path, events: list[tuple[np.ndarray, np.ndarray]]) -> Path:
    """Sparse larcv3 groups for events ``(image [P, n1, n0], labels [P, n1, n0])``."""
    with h5py.File(path, "w") as f:
        for group, which in ((IMAGE_GROUP, 0), (LABEL_GROUP, 1)):
            ext, metas, vext, vox = [], [], [], []
            for ev in events:
                planes = ev[which]
                ext.append((len(metas), len(planes)))
                for p, plane in enumerate(planes):
                    n1, n0 = plane.shape
                    i1, i0 = np.nonzero(ev[0][p])  # voxels where there is charge
                    ids = np.sort(i0.astype(np.uint64) * n1 + i1)
                    vals = plane.T.reshape(-1)[ids.astype(np.int64)]
                    vext.append((sum(len(v) for v in vox), len(ids), p))
                    vox.append(np.array(list(zip(ids, vals)), VOX))
                    metas.append((1, p, (n0, n1), (n0, n1), (0, 0)))
            g = f.create_group(group)
            g["extents"] = np.array(ext, EXT)
            g["image_meta"] = np.array(metas, META)
            g["voxel_extents"] = np.array(vext, VEXT)
            g["voxels"] = np.concatenate(vox) if vox else np.zeros(0, VOX)
    return path


def tiny_event(seed: int, shape=(3, 6, 10)) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    image = np.where(rng.random(shape) < 0.4, rng.uniform(5, 50, shape), 0).astype(np.float32)
    labels = np.where(image > 0, rng.integers(0, 3, shape), 0).astype(np.uint8)
    return image, labels
