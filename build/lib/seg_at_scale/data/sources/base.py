"""The shape every dataset source has, the one folder rule around it and the one seed rule.

A source turns something (a seed, a Cityscapes tree, a TACO ``annotations.json``, a larcv3
file) into scenes, ``<root>/<split>/<name>_image.tif`` with ``<name>_mask.tif`` beside. It
is a small class, built from the ``data.synthetic`` node of its config
(``splits``, ``height``, ``width``, ``seed`` and its own ``options``), that says:

* ``name`` and ``needs``: what it is called in messages and what must exist first;
* ``classes``: its class table (index = mask value), or None when the config names them;
* :meth:`Source.parameters`: everything the folder's pixels depend on (the manifest);
* :meth:`Source.plan`: the scene names of each split, known before anything is written
  (asked only when the folder is to be written);
* :meth:`Source.write`: one scene, given its folder, name and seed.

:meth:`Source.build` is the same for every source: the folder rule of
:mod:`seg_at_scale.data.manifest` (same parameters: reuse; other parameters: refused naming
each differing key, or rebuilt with ``overwrite``), then each planned scene written with
its seed from :func:`scene_seed` (a rebuild first removes the scenes the old manifest
lists that the new plan lacks), then the manifest, last.

>>> scene_seed(0, "train", 0) == scene_seed(0, "train", 0) != scene_seed(0, "val", 0)
True
"""

from __future__ import annotations

import os
import zlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from seg_at_scale.data import manifest
from seg_at_scale.data.synthetic import _hash  # the generator's coordinate hash
from seg_at_scale.errors import ConfigError

__all__ = ["Source", "scene_seed", "scene_files", "check_splits"]


def scene_seed(seed: int, split: str, index: int) -> int:
    """The seed of scene ``index`` of ``split`` (stable across runs, machines, processes)."""
    return int(_hash(seed, zlib.crc32(split.encode()), index, 0x5CE7E)) >> 1


def scene_files(root: Path, names: Mapping[str, list[str]]) -> list[Path]:
    """The image and mask paths of the planned scenes."""
    return [root / s / f"{n}_{kind}.tif" for s, ns in names.items() for n in ns
            for kind in ("image", "mask")]


def check_splits(splits: Mapping[str, Any]) -> dict[str, int]:
    """``data.synthetic.splits`` as ``{folder name: count >= 0}``, refused naming a bad one."""
    out = {}
    for name, count in splits.items():
        if (not name or "/" in str(name) or "\\" in str(name) or isinstance(count, bool)
                or not isinstance(count, int) or count < 0):
            raise ConfigError(f"data.synthetic.splits: split {name!r} with {count!r} scenes; "
                              "use a plain folder name and a whole number >= 0")
        out[str(name)] = count
    return out


class Source(ABC):
    """One dataset source (see the module).

    Subclasses fill in the class attributes and the three abstract methods.

    Args:
        splits: scenes per split (some sources: 0 = all the source has).
        height, width: scene size (generators), or the size to fit into (converters;
            None keeps the source's).
        seed: dataset seed; scene ``k`` of split ``s`` is written with
            ``scene_seed(seed, s, k)``.
    """

    name: ClassVar[str]
    needs: ClassVar[str] = "nothing"
    classes: tuple[str, ...] | None = None  # a class attribute, or set from the source

    def __init__(self, splits: Mapping[str, int], height: int | None = None,
                 width: int | None = None, seed: int = 0) -> None:
        self.splits = check_splits(splits)
        self.height, self.width, self.seed = height, width, int(seed)

    @abstractmethod
    def parameters(self) -> dict[str, Any]:
        """Everything the folder's pixels depend on (JSON values): its manifest."""

    @abstractmethod
    def plan(self) -> dict[str, list[str]]:
        """Scene names per split, before anything is written (the source is checked here)."""

    @abstractmethod
    def write(self, folder: Path, name: str, seed: int) -> None:
        """Write scene ``name`` into ``folder`` (created) as image + mask."""

    def build(self, root: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write (or reuse) the dataset under ``root``; returns ``root``.

        Raises:
            InputError: ``root`` holds a dataset made with other parameters (the message
                names each differing key) and ``overwrite`` is false.
            OutputExistsError: scene files without a manifest and ``overwrite`` is false.
        """
        root = Path(root)
        params = self.parameters()
        # reuse asks only the manifest (the files it lists): a converted folder is reused
        # without listing, or even having, its source
        if manifest.reuse(root, self.name, params, overwrite=overwrite):
            return root
        names = self.plan()
        files = scene_files(root, names)
        for stale in set(manifest.listed(root)) - set(files):  # an older dataset's scenes
            stale.unlink(missing_ok=True)
        if manifest.interrupted_build(root, params):
            manifest.clear_partials(files)  # a killed writer's temporary files
        manifest.begin(root, self.name, params)  # a killed build is resumed, not refused
        for split, scenes in names.items():
            for k, name in enumerate(scenes):
                self.write(root / split, name, scene_seed(self.seed, split, k))
        manifest.save(root, self.name, params, files, scenes=names)
        return root
