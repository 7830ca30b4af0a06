"""DataModules built from the shipped config groups, for tests that do not run the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

import seg_at_scale
from seg_at_scale.data.datamodule import TileDataModule
from seg_at_scale.tiling import Footprint

CONF = Path(seg_at_scale.__file__).parent / "conf"


def group(name: str, option: str, **values: Any) -> dict[str, Any]:
    """``conf/<name>/<option>.yaml`` as a plain dict with ``values`` in place (unresolved)."""
    node = OmegaConf.merge(OmegaConf.load(CONF / name / f"{option}.yaml"), values)
    out = OmegaConf.to_container(node, resolve=False)
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]


def tiff_module(root: str | Path, fp: Footprint, num_classes: int, *, bands: int = 3,
                tiling: str = "grid", seed: int = 0, data: dict[str, Any] | None = None,
                **tiling_values: Any) -> TileDataModule:
    """``data=tiff`` over ``root`` (scale 1/255, mean 0, std 1, no worker processes) with
    ``tiling=<tiling>`` (no augmentation unless given)."""
    keys = group("data", "tiff", **{"root": str(root), "bands": bands,
                                    "num_classes": num_classes, "scale": 1 / 255, "mean": [0.0],
                                    "std": [1.0], "class_weights": None, "num_workers": 0,
                                    **(data or {})})
    del keys["_target_"]
    tiling_values = {"augment": None, **tiling_values}
    return TileDataModule(group("tiling", tiling, **tiling_values), fp, seed=seed, **keys)
