"""Helpers for the prediction tests: a run folder with random weights, a georeferenced
image, and ``seg-predict`` in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from helpers import warm
from seg_at_scale.io import example_geotags, write_raster
from seg_at_scale.models import UNet
from seg_at_scale.tiling import Footprint

CLASSES = ["background", "vegetation", "water", "road", "building"]
NORM = {"scale": 1 / 255, "mean": [0.5], "std": [0.25]}
#: the height and width of the ``cli_case`` fixture's scene (tests/conftest.py)
CLI_SHAPE = (263, 377)


def make_model(padding: str = "same", levels: int = 3, width: int = 8, seed: int = 0) -> UNet:
    torch.manual_seed(seed)
    model = UNet(4, 5, levels=levels, base_width=width, padding=padding).eval()
    head = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)][-1]
    with torch.no_grad():  # an untrained net predicts one class: spread the logits
        head.weight.mul_(30.0)
        head.bias.zero_()
    return model


def make_run(folder: Path, model: UNet) -> Path:
    """A run folder as seg-train leaves it: run_config.yaml and checkpoints/last.ckpt."""
    node = {"_target_": "seg_at_scale.models.UNet", "in_channels": 4, "num_classes": 5,
            "levels": model.levels, "base_width": model.base_width, "padding": model.padding}
    data = {"bands": 4, "num_classes": 5, "class_names": CLASSES, "ignore_index": 255,
            "nodata": None, **NORM}
    return write_run(folder, node, model, data, high=230.0)


def write_run(folder: Path, node: dict[str, Any], net: torch.nn.Module, data: dict[str, Any],
              *, fp: Footprint | None = None, tiling: dict[str, Any] | None = None,
              high: float | None = None) -> Path:
    """A run folder for ``net`` built from the model config ``node``: ``run_config.yaml``
    (its model, ``data`` and ``tiling`` nodes and the computed footprint ``fp``, by default
    the network's exact one) and ``checkpoints/last.ckpt`` holding the weights as
    ``seg-train`` saves them. ``high`` is the training images' largest value, if known."""
    (folder / "checkpoints").mkdir(parents=True, exist_ok=True)
    fp = fp or net.footprint()  # type: ignore[operator]
    seen = {"dtype": "uint8", **({} if high is None else {"high": high})}
    cfg = {"model": node, "data": data, "tiling": tiling or {"halo": "auto"},
           "computed": {"halo": fp.halo, "align": fp.align, "padding": fp.padding,
                        "out_residue": fp.out_residue, "input": seen}}
    (folder / "run_config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg)))
    state = {f"model.{k}": v for k, v in net.state_dict().items()}
    torch.save({"state_dict": state}, folder / "checkpoints" / "last.ckpt")
    return folder


def make_planes_run(folder: Path, depth: int = 2, mean: float = 0.0,
                    std: float = 1.0) -> tuple[Path, torch.nn.Module]:
    """A run folder of a random UResNet (3 detector planes x 3 classes) and its network."""
    from seg_at_scale.models import UResNet

    torch.manual_seed(0)
    net = UResNet(planes=3, num_classes=3, depth=depth, initial_filters=4).eval()
    node = {"_target_": "seg_at_scale.models.UResNet", "planes": 3, "num_classes": 3,
            "depth": depth, "initial_filters": 4}
    data = {"bands": 3, "num_classes": 3, "class_names": ["background", "cosmic", "neutrino"],
            "ignore_index": 255, "nodata": None, "scale": 0.02, "mean": [mean], "std": [std]}
    return write_run(folder, node, net, data), net


def make_image(path: Path, height: int = 517, width: int = 743, seed: int = 1) -> Path:
    """A 4-band uint8 GeoTIFF with structure (smooth fields + noise), not a round size."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = [np.sin(yy / (17 + 5 * b)) * np.cos(xx / (23 + 3 * b)) for b in range(4)]
    img = np.stack(base) * 90 + 128 + rng.normal(0, 20, (4, height, width))
    return write_raster(path, img.clip(0, 255).astype(np.uint8), tile=(64, 64),
                        geotags=example_geotags(origin=(500000.0, 4500000.0), pixel_size=10.0))


def predict_cmd(run: Path, image: Path, output: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "seg_at_scale.cli.predict", f"run={run}", f"image={image}",
            f"output={output}", "progress=false",
            *overrides]


def env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CI": "true",
            "OMP_NUM_THREADS": "1", "HOME": os.environ.get("HOME", "/tmp")}


def seg_predict(run: Path, image: Path, output: Path, *overrides: str,
                timeout: int = 300, check: bool = True) -> dict | subprocess.CompletedProcess:
    out = warm.run(predict_cmd(run, image, output, *overrides), capture_output=True,
                   text=True, env=env(), timeout=timeout)
    if not check:
        return out
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout[out.stdout.index("{"):])


def chunks_written(store: Path) -> int:
    folder = store / "labels" / "c"
    return sum(1 for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".partial")
               and "." not in p.name) if folder.exists() else 0


def leftovers(folder: Path, name: str) -> list[str]:
    """Temporary files of ``name`` left in ``folder`` (the lock and store excluded)."""
    return sorted(p.name for p in folder.iterdir()
                  if p.name.startswith(f".{name}.") and p.name.endswith(".tmp"))


def seg_predict_here(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``seg-predict`` run in this process (its refusals need no new Python: ~0.1 s, not ~3).

    The same entry point as the console script: the override precheck, Hydra, the one-line
    error wrapper and its exit status; stdout and stderr are captured.
    """
    from helpers.cli import run_here
    from seg_at_scale.cli.predict import main

    return run_here(main, ["seg-predict", "progress=false", *args], cwd=cwd)
