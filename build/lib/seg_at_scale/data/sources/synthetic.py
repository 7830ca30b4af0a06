"""The synthetic satellite scenes on disk (data=synthetic, the demo's default source).

:class:`SyntheticScenes` (``make_dataset`` as a function) is called on every demo run: it
writes the scenes of :class:`~seg_at_scale.data.synthetic.SceneGenerator` as tiled
GeoTIFFs once and reuses them while ``manifest.json`` records the same parameters.

Its :meth:`~SyntheticScenes.build` keeps the folder rule of every source
(:class:`~seg_at_scale.data.sources.base.Source`) and adds two things the demo's large
scenes want: a folder with the same parameters but missing files gets only those files
written again, and its manifest lists every scene with its seed (:class:`DatasetManifest`,
which ``seg-synth`` prints).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from seg_at_scale.data import manifest
from seg_at_scale.data.sources.base import Source, check_splits, scene_seed
from seg_at_scale.data.synthetic import CLASSES, GENERATOR_VERSION, IGNORE_INDEX, SceneGenerator
from seg_at_scale.errors import ConfigError, InputError
from seg_at_scale.io import check_output_path, example_geotags, write_raster_bands
from seg_at_scale.tiling.geometry import Window

__all__ = [
    "DEFAULT_SPLITS",
    "DatasetManifest",
    "SyntheticScenes",
    "make_dataset",
    "write_scene",
]

DEFAULT_SPLITS: Mapping[str, int] = MappingProxyType({"train": 8, "val": 2, "test": 1})


def write_scene(image_path: str | os.PathLike[str], mask_path: str | os.PathLike[str],
                gen: SceneGenerator, *, tile: tuple[int, int] | None = (256, 256),
                band_rows: int = 1024, compression: str | None = "zlib",
                overwrite: bool = False) -> tuple[Path, Path]:
    """Stream a whole scene to a (Geo)TIFF image and mask, ``band_rows`` rows at a time.

    The mask is written by a second thread that renders it on its own (mask-only rendering
    is ~4x cheaper than the image), so memory stays at one band of rows per file and the
    two files are compressed in parallel. Both carry :func:`example_geotags`.

    Args:
        image_path: output image, ``[bands, H, W]`` of ``gen.dtype``.
        mask_path: output mask, ``[H, W]`` uint8 class indices.
        gen: the scene.
        tile: TIFF tile size, or None for strips.
        band_rows: rows rendered per step (memory: ``band_rows * W * (bands + 1)`` bytes
            plus ~50 bytes per pixel of a 1024 x 1024 block).
        compression: ``tifffile`` compression name, or None.
        overwrite: replace existing outputs.

    Returns:
        ``(image_path, mask_path)``.

    Raises:
        OutputExistsError: an output exists and ``overwrite`` is false (nothing is written).
    """
    if band_rows < 1:
        raise ConfigError(f"band_rows={band_rows} must be >= 1")
    image_path = check_output_path(image_path, overwrite, key="image_path")
    mask_path = check_output_path(mask_path, overwrite, key="mask_path")
    windows = [Window(r, 0, min(band_rows, gen.height - r), gen.width)
               for r in range(0, gen.height, band_rows)]
    options: dict[str, Any] = dict(tile=tile, compression=compression,
                                   geotags=example_geotags(), overwrite=overwrite)
    masks: Iterator[np.ndarray] = (gen.render_mask(w) for w in windows)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="synth-mask") as pool:
        mask_job = pool.submit(write_raster_bands, mask_path, (1, gen.height, gen.width),
                               np.uint8, masks, **options)
        images = (gen.render(w)[0] for w in windows)
        write_raster_bands(image_path, gen.shape, gen.dtype, images, **options)
        mask_job.result()
    return image_path, mask_path


@dataclass(frozen=True)
class DatasetManifest:
    """What :func:`make_dataset` wrote (``root/manifest.json``).

    Attributes:
        root: dataset folder.
        parameters: everything the pixels depend on (generator version, seed, size, splits).
        classes: class names, index = mask value.
        files: split -> ``((image, mask), ...)`` absolute paths.
        seeds: split -> per-scene seeds (``SceneGenerator(seed, height, width)``).
        ignore_index: mask value that is not a class (unused by the generator).
    """

    root: Path
    parameters: dict[str, Any]
    classes: tuple[str, ...]
    files: dict[str, tuple[tuple[Path, Path], ...]]
    seeds: dict[str, tuple[int, ...]]
    ignore_index: int = IGNORE_INDEX

    @property
    def path(self) -> Path:
        """The manifest file."""
        return self.root / "manifest.json"

    def all_files(self) -> list[Path]:
        """Every image and mask path, split by split."""
        return [p for pairs in self.files.values() for pair in pairs for p in pair]

    def to_json(self) -> dict[str, Any]:
        """Serialise with paths relative to ``root`` (the folder can be moved)."""
        return {"parameters": self.parameters, "classes": list(self.classes),
                "ignore_index": self.ignore_index,
                "files": {s: [{"image": i.relative_to(self.root).as_posix(),
                               "mask": m.relative_to(self.root).as_posix(), "seed": seed}
                              for (i, m), seed in zip(pairs, self.seeds[s], strict=True)]
                          for s, pairs in self.files.items()}}

    @classmethod
    def load(cls, root: str | os.PathLike[str]) -> DatasetManifest:
        """Read ``root/manifest.json``.

        Raises:
            InputError: the manifest is missing or unreadable.
        """
        root = Path(root)
        try:
            data = json.loads((root / "manifest.json").read_text())
            files = {s: tuple((root / e["image"], root / e["mask"]) for e in entries)
                     for s, entries in data["files"].items()}
            seeds = {s: tuple(int(e["seed"]) for e in entries)
                     for s, entries in data["files"].items()}
            return cls(root, dict(data["parameters"]), tuple(data["classes"]), files, seeds,
                       int(data["ignore_index"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(f"cannot read dataset manifest '{root / 'manifest.json'}': {exc}. "
                             "Delete the folder or pass overwrite=True to regenerate it") from exc

    def save(self) -> Path:
        """Write the manifest atomically (last, so it only ever describes complete files)."""
        tmp = self.path.with_name(".manifest.json.partial")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        os.replace(tmp, self.path)
        return self.path


def _plan(root: Path, splits: Mapping[str, int], height: int, width: int,
          seed: int) -> DatasetManifest:
    """Describe the dataset ``make_dataset`` is asked for, before writing anything."""
    splits = check_splits(splits)
    params = {"generator_version": GENERATOR_VERSION, "seed": int(seed), "height": int(height),
              "width": int(width), "splits": {s: int(n) for s, n in splits.items()}}
    files = {s: tuple((root / s / f"scene_{k}_image.tif", root / s / f"scene_{k}_mask.tif")
                      for k in range(n)) for s, n in splits.items()}
    seeds = {s: tuple(scene_seed(seed, s, k) for k in range(n)) for s, n in splits.items()}
    return DatasetManifest(root, params, CLASSES, files, seeds)


def make_dataset(root: str | os.PathLike[str], *, splits: Mapping[str, int] = DEFAULT_SPLITS,
                 height: int = 1024, width: int = 1024, seed: int = 0,
                 overwrite: bool = False) -> DatasetManifest:
    """Create (or reuse) the synthetic dataset ``root/<split>/scene_<k>_{image,mask}.tif``.

    Reuse is the common case (the demo calls this on every run): if ``root/manifest.json``
    records the same parameters and all its files exist, nothing is written.

    Args:
        root: dataset folder (created).
        splits: scenes per split.
        height: scene height in px.
        width: scene width in px.
        seed: dataset seed; scene ``k`` of split ``s`` uses ``scene_seed(seed, s, k)``.
        overwrite: regenerate a dataset made with other parameters, and replace files
            that exist without a manifest.

    Returns:
        The manifest.

    Raises:
        InputError: ``root`` holds a dataset made with other parameters and ``overwrite``
            is false; the message names the parameter.
        OutputExistsError: a scene file exists without a manifest and ``overwrite`` is false.
    """
    return SyntheticScenes(splits, height, width, seed).build(root, overwrite=overwrite)


def _existing(want: DatasetManifest, overwrite: bool) -> DatasetManifest | None:
    """Load the manifest already in ``want.root``, if any (unreadable + overwrite: None)."""
    if not want.path.exists():
        return None
    try:
        return DatasetManifest.load(want.root)
    except InputError:
        if overwrite:
            return None
        raise


class SyntheticScenes(Source):
    """The synthetic satellite scenes ``<root>/<split>/scene_<k>_{image,mask}.tif``.

    ``data.synthetic.generator`` of ``data=synthetic``; needs nothing.
    """

    name = "synthetic"
    classes = CLASSES

    def __init__(self, splits: Mapping[str, int] = DEFAULT_SPLITS, height: int = 1024,
                 width: int = 1024, seed: int = 0) -> None:
        super().__init__(splits, int(height), int(width), seed)

    def _planned(self, root: Path) -> DatasetManifest:
        return _plan(root, self.splits, self.height, self.width,  # type: ignore[arg-type]
                     self.seed)

    def parameters(self) -> dict[str, Any]:
        return self._planned(Path()).parameters

    def plan(self) -> dict[str, list[str]]:
        return {s: [f"scene_{k}" for k in range(n)] for s, n in self.splits.items()}

    def write(self, folder: Path, name: str, seed: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        gen = SceneGenerator(seed, self.height, self.width)  # type: ignore[arg-type]
        write_scene(folder / f"{name}_image.tif", folder / f"{name}_mask.tif", gen,
                    overwrite=True)

    def build(self, root: str | os.PathLike[str], *,  # type: ignore[override]
              overwrite: bool = False) -> DatasetManifest:
        """The folder rule, resuming missing files (module docstring); the manifest."""
        want = self._planned(Path(root))
        # the one rule (data/manifest.py); missing files of a matching dataset are made below
        resumed = manifest.interrupted_build(want.root, want.parameters)
        same = manifest.reuse(want.root, self.name, want.parameters, overwrite=overwrite,
                              files=[]) or resumed
        old = None if same else _existing(want, overwrite=True)  # its stale files go below
        if not same or resumed:
            manifest.begin(want.root, self.name, want.parameters)  # before the first scene
        if resumed:
            manifest.clear_partials(want.all_files())  # a killed writer's temporary files
        written = 0
        for split, pairs in want.files.items():
            for k, pair in enumerate(pairs):
                if same and all(p.exists() for p in pair):
                    continue  # reuse
                self.write(pair[0].parent, pair[0].name[: -len("_image.tif")],
                           want.seeds[split][k])
                written += 1
        if old is not None:  # files of an older, different dataset that no longer belong
            for stale in set(old.all_files()) - set(want.all_files()):
                stale.unlink(missing_ok=True)
        if written or not same or resumed:
            want.root.mkdir(parents=True, exist_ok=True)
            want.save()
            (want.root / manifest.BUILDING).unlink(missing_ok=True)
        return want
