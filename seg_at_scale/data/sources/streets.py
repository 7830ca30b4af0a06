"""Street scenes on disk: the RGB + Canny scene writer and a synthetic street generator.

Gated-SCNN fuses its boundary map with the image gradient. The gradient is computed here,
once, on the whole image when a scene is written, and stored as a 4th band (0 / 255), so
the model never computes it and halo tiling stays exact. Cityscapes, TACO and the
synthetic streets all go through :func:`write_street_scene`.

The synthetic scenes (:class:`Streets`, the default of ``data=streets``) are perspective
street views: sky, buildings with windows, road and sidewalk in nearly the same grey (told
apart by their shape and position), trees, cars and thin poles. Deterministic from the
seed::

    Streets({"train": 8, "val": 2, "test": 1}, height=256, width=512, seed=0).build(
        "data/streets")
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from seg_at_scale.data.sources.base import Source
from seg_at_scale.errors import InputError
from seg_at_scale.io import check_output_path, write_raster

__all__ = ["STREET_CLASSES", "canny_band", "write_street_scene", "fit_scene", "read_rgb",
           "render_street", "Streets"]

STREET_CLASSES = ("road", "sidewalk", "building", "vegetation", "sky", "car", "pole")
ROAD, SIDEWALK, BUILDING, VEGETATION, SKY, CAR, POLE = range(len(STREET_CLASSES))
VERSION = 2  # 2: scene seeds from the one rule (sources.base.scene_seed)


def canny_band(rgb: np.ndarray, low: int = 50, high: int = 150, sigma: float = 1.0,
               ) -> np.ndarray:
    """Canny edges of an RGB image: ``[3, H, W]`` uint8 -> ``[H, W]`` uint8 in {0, 255}.

    Grey level (ITU-R 601 weights), Gaussian blur of ``sigma`` (skipped when 0), then
    OpenCV's Canny with hysteresis thresholds ``low`` / ``high`` on the Sobel magnitude.
    """
    if rgb.ndim != 3 or rgb.shape[0] != 3 or rgb.dtype != np.uint8:
        raise InputError(f"canny_band needs an RGB uint8 image [3, H, W], got {rgb.dtype} "
                         f"{list(rgb.shape)}")
    grey = cv2.cvtColor(np.ascontiguousarray(rgb.transpose(1, 2, 0)), cv2.COLOR_RGB2GRAY)
    if sigma > 0:
        grey = cv2.GaussianBlur(grey, (0, 0), sigma)
    return cv2.Canny(grey, low, high)


def write_street_scene(folder: str | os.PathLike[str], name: str, rgb: np.ndarray,
                       mask: np.ndarray, *, overwrite: bool = False,
                       tile: tuple[int, int] | None = (256, 256)) -> tuple[Path, Path]:
    """Write ``<folder>/<name>_image.tif`` (R, G, B, Canny) and ``<name>_mask.tif``.

    Args:
        folder: split folder (created).
        name: scene name.
        rgb: ``[3, H, W]`` uint8.
        mask: ``[H, W]`` uint8 class ids (255 = ignore).
        overwrite: replace existing files.
        tile: TIFF tile size (multiples of 16) or None for strips.

    Returns:
        ``(image path, mask path)``.
    """
    if mask.shape != rgb.shape[1:]:
        raise InputError(f"scene {name}: mask is {mask.shape[0]}x{mask.shape[1]} but the image "
                         f"is {rgb.shape[1]}x{rgb.shape[2]}; give a mask of the image's size")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    img = check_output_path(folder / f"{name}_image.tif", overwrite, key="image")
    msk = check_output_path(folder / f"{name}_mask.tif", overwrite, key="mask")
    bands = np.concatenate([rgb, canny_band(rgb)[None]], axis=0)
    write_raster(img, bands, tile=tile, overwrite=overwrite)
    write_raster(msk, mask.astype(np.uint8), tile=tile, overwrite=overwrite)
    return img, msk


def fit_scene(rgb: np.ndarray, mask: np.ndarray, height: int | None,
              width: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Scale a scene down (aspect kept) to fit ``height x width``; None or 0 keeps it.

    The image is resampled by area averaging, the mask by nearest neighbour.
    """
    h, w = mask.shape
    s = min((height or h) / h, (width or w) / w, 1.0)
    if s >= 1.0:
        return rgb, mask
    size = (max(1, round(w * s)), max(1, round(h * s)))
    img = cv2.resize(np.ascontiguousarray(rgb.transpose(1, 2, 0)), size,
                     interpolation=cv2.INTER_AREA)
    return img.transpose(2, 0, 1), cv2.resize(mask, size, interpolation=cv2.INTER_NEAREST)


def read_rgb(path: Path, size: tuple[int, int] | None = None) -> np.ndarray:
    """An image file as RGB ``[3, H, W]`` uint8; ``size=(H, W)`` checks it (EXIF-aware)."""
    img = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if img is None:
        raise InputError(f"cannot read image '{path}': missing or not an image; check the "
                         "dataset folder")
    if size is not None and img.shape[:2] != tuple(size):
        raw = cv2.imread(str(path), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
        if raw is None or raw.shape[:2] != tuple(size):
            raise InputError(f"image '{path}' is {img.shape[0]}x{img.shape[1]} but its "
                             f"annotation says {size[0]}x{size[1]}; fix the annotation file")
        img = raw
    return img[..., ::-1].transpose(2, 0, 1).copy()


# ----- the synthetic street generator ------------------------------------------------------


def _shade(rng: np.random.Generator, base: tuple[int, int, int], jitter: int) -> np.ndarray:
    return np.clip(np.array(base) + rng.integers(-jitter, jitter + 1, 3), 0, 255)


def _paint(img: np.ndarray, mask: np.ndarray, where: np.ndarray, label: int,
           colour: np.ndarray) -> None:
    mask[where] = label
    img[:, where] = colour[:, None]


def render_street(height: int, width: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One street scene: ``(rgb [3, H, W] uint8, mask [H, W] uint8)``; same seed, same scene."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    img: np.ndarray = np.zeros((3, height, width), np.float32)
    mask = np.full((height, width), SKY, np.uint8)
    horizon = height * rng.uniform(0.35, 0.5)
    vx = width * rng.uniform(0.35, 0.65)
    depth = np.clip((yy - horizon) / (height - horizon), 0, None)  # 0 at horizon, 1 at bottom
    sky = np.array([[[120]], [[160]], [[215]]]) + 30 * (yy / height)[None]
    img[:] = sky
    road_half = width * rng.uniform(0.3, 0.45) * depth
    walk_half = road_half * rng.uniform(1.25, 1.45)
    below = yy >= horizon
    # buildings: a skyline of facades above the ground, left and right of the street
    x = 0
    while x < width:
        w = int(rng.integers(width // 12, width // 4))
        top = horizon - height * rng.uniform(0.05, 0.35)
        facade = (xx >= x) & (xx < x + w) & (yy >= top) & (np.abs(xx - vx) > walk_half) & \
            (rng.uniform() > 0.15)
        colour = _shade(rng, (150, 120, 100), 50)
        _paint(img, mask, facade, BUILDING, colour)
        win = facade & ((yy - top) % 24 > 8) & ((xx - x) % 18 > 8)
        img[:, win] = (colour * 0.45)[:, None]  # windows: part of the building
        x += w
    grey = rng.uniform(95, 120)
    _paint(img, mask, below & (np.abs(xx - vx) <= walk_half) & (np.abs(xx - vx) > road_half),
           SIDEWALK, np.array([grey + 12, grey + 12, grey + 10]))
    _paint(img, mask, below & (np.abs(xx - vx) <= road_half), ROAD, np.array([grey] * 3))
    _street_objects(rng, img, mask, xx, yy, horizon, vx, road_half, walk_half, depth)
    img += rng.normal(0, 6, img.shape)
    img = cv2.GaussianBlur(img.transpose(1, 2, 0), (0, 0), 0.7).transpose(2, 0, 1)
    return np.clip(img, 0, 255).astype(np.uint8), mask


def _street_objects(rng: np.random.Generator, img: np.ndarray, mask: np.ndarray,
                    xx: np.ndarray, yy: np.ndarray, horizon: float, vx: float,
                    road_half: np.ndarray, walk_half: np.ndarray, depth: np.ndarray) -> None:
    """Trees, poles and cars, each scaled by the perspective at its ground row."""
    height = mask.shape[0]
    for _ in range(int(rng.integers(2, 6))):  # trees at the outer sidewalk edge
        gy = horizon + (height - horizon) * rng.uniform(0.1, 0.7)
        d = (gy - horizon) / (height - horizon)
        r = 10 + 80 * d
        gx = vx + rng.choice([-1, 1]) * (float(walk_half[int(gy), 0]) + 0.5 * r)
        crown = (xx - gx) ** 2 + ((yy - (gy - 2.2 * r)) / 0.9) ** 2 < r**2
        _paint(img, mask, crown, VEGETATION, _shade(rng, (60, 120, 50), 25))
    for _ in range(int(rng.integers(2, 5))):  # poles: thin, in the road's grey
        gy = horizon + (height - horizon) * rng.uniform(0.2, 0.9)
        d = (gy - horizon) / (height - horizon)
        side = rng.choice([-1, 1])
        gx = vx + side * (np.abs(road_half[int(gy), 0]) + 2) + side * 3 * d
        half = max(1.0, 3 * d)
        pole = (np.abs(xx - gx) <= half) & (yy <= gy) & (yy >= gy - height * 0.6 * d - 8)
        _paint(img, mask, pole, POLE, _shade(rng, (105, 105, 110), 10))
    for _ in range(int(rng.integers(1, 5))):  # cars on the road
        gy = horizon + (height - horizon) * rng.uniform(0.15, 0.95)
        d = (gy - horizon) / (height - horizon)
        gx = vx + rng.uniform(-0.7, 0.7) * max(float(np.abs(xx - vx).max()) * 0.4 * d, 1)
        w, h = 10 + 200 * d, 6 + 90 * d
        body = (np.abs(xx - gx) <= w / 2) & (yy <= gy) & (yy >= gy - h)
        colour = _shade(rng, (120, 100, 100), 90)
        _paint(img, mask, body, CAR, colour)
        glass = body & (yy < gy - 0.6 * h) & (np.abs(xx - gx) <= w * 0.35)
        img[:, glass] = np.array([60, 70, 80])[:, None]
        wheels = body & (yy > gy - 0.25 * h) & (np.abs(np.abs(xx - gx) - w * 0.3) < w * 0.1)
        img[:, wheels] = 25.0


class Streets(Source):
    """Synthetic street scenes ``<root>/<split>/street_<k>_{image,mask}.tif`` (data=streets).

    ``data.synthetic.generator: seg_at_scale.data.sources.streets.Streets``; needs nothing.
    """

    name = "streets"
    classes = STREET_CLASSES

    def __init__(self, splits: Mapping[str, int], height: int, width: int,
                 seed: int = 0) -> None:
        super().__init__(splits, int(height), int(width), seed)

    def parameters(self) -> dict[str, Any]:
        return {"generator": "streets", "version": VERSION, "seed": self.seed,
                "height": self.height, "width": self.width, "splits": self.splits,
                "classes": list(STREET_CLASSES)}

    def plan(self) -> dict[str, list[str]]:
        return {s: [f"street_{k}" for k in range(n)] for s, n in self.splits.items()}

    def write(self, folder: Path, name: str, seed: int) -> None:
        rgb, mask = render_street(self.height, self.width, seed)  # type: ignore[arg-type]
        write_street_scene(folder, name, rgb, mask, overwrite=True)
