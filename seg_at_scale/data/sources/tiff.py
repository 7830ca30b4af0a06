"""Your own scenes, already in the layout (data=tiff): a source that writes nothing.

``<root>/<split>/<name>_image.tif`` with ``<name>_mask.tif`` beside, or
``<root>/<split>/images/<name>.tif`` with ``masks/<name>.tif``; any TIFF / BigTIFF /
GeoTIFF. :meth:`TiffFolder.build` only checks, before the run starts, that every split it
is given exists and holds scenes; the preflight (:mod:`seg_at_scale.data.preflight`) then
reads their headers and pixels. Its class table is ``data.class_names``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from seg_at_scale.data.scenes import find_scenes
from seg_at_scale.data.sources.base import Source

__all__ = ["TiffFolder"]


class TiffFolder(Source):
    """Scenes you made (``data.synthetic.generator`` of ``data=tiff``).

    Args:
        splits: the split folders that must hold scenes (counts are not checked: 0 = any).
    """

    name = "tiff"
    needs = ("your scenes under data.root/<split>/ (<name>_image.tif + <name>_mask.tif, or "
             "images/<name>.tif + masks/<name>.tif)")

    def __init__(self, splits: Mapping[str, int], height: int | None = None,
                 width: int | None = None, seed: int = 0) -> None:
        super().__init__(splits, height, width, seed)

    def parameters(self) -> dict[str, Any]:
        return {}

    def plan(self) -> dict[str, list[str]]:
        return {}

    def write(self, folder: Path, name: str, seed: int) -> None:
        raise AssertionError("a TIFF folder is never written")  # plan() is empty

    def build(self, root: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Check that each split holds scenes (nothing is written, ``overwrite`` unused)."""
        root = Path(root)
        for split in self.splits:
            find_scenes(root / split, key=f"data.root ({split} split)")
        return root
