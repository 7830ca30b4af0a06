"""``seg-predict`` of smp runs: whole-image statistics across ranks, runs without their
pretrained weights files, and ``tiling.exact=false`` said in the output."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import rasterio
import torch
from helpers.prediction import make_image, seg_predict, seg_predict_here, write_run
from helpers.smp import lively, model_node, preset_model
from test_smp_files import DATA, check_labels

from seg_at_scale.io import read_raster
from seg_at_scale.models.smp import SMPModel
from seg_at_scale.prediction.provenance import TILING_TAG
from seg_at_scale.tiling import predict_full

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SE = {"_target_": "seg_at_scale.models.SMPModel", "arch": "Unet",
      "encoder": "tu-test_efficientnet", "in_channels": 4, "num_classes": 3,
      "options": {"decoder_channels": [16, 16, 8, 8, 8]}}


def smp_run(folder: Path, node: dict, net: torch.nn.Module, *, exact: bool = True) -> Path:
    """A run folder as seg-train leaves it for ``net`` (its config ``node``), the data
    normalised as ``DATA``; the pretrained weights file the config names does not exist."""
    fp = net.footprint() if exact else net.approximate_footprint()
    data = {"bands": 4, "num_classes": int(node["num_classes"]), "class_names": None,
            "ignore_index": 255, "nodata": None, "scale": DATA.scale, "mean": list(DATA.mean),
            "std": list(DATA.std)}
    gone = str(folder / "gone" / "encoder.safetensors")
    return write_run(folder, {**node, "encoder_weights": gone}, net, data, fp=fp,
                     tiling={"halo": "auto", "exact": exact})


def tiling_tag(path: Path) -> str:
    with rasterio.open(path) as ds:
        return ds.tags()[TILING_TAG]


def test_fpn_run_one_and_two_ranks_equal_untiled_without_the_weights_file(tmp_path):
    net = preset_model("fpn_test_resnet")
    run = smp_run(tmp_path / "run", model_node("fpn_test_resnet"), net)
    image = make_image(tmp_path / "scene.tif", height=421, width=389)
    tile = "q=2"  # the scene fits one tile of any legal size
    res = seg_predict_here(f"run={run}", f"image={image}", f"output={tmp_path / 'one.tif'}",
                           "ckpt=last", "fast=false", tile)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["exact"] is True
    two = seg_predict(run, image, tmp_path / "two.tif", "ckpt=last", "fast=false", tile,
                      "processes=2")
    assert two["processes"] == 2
    assert (tmp_path / "one.tif").read_bytes() == (tmp_path / "two.tif").read_bytes()
    assert tiling_tag(tmp_path / "one.tif") == "exact"
    x = torch.from_numpy(DATA(read_raster(image)))[None]
    check_labels(read_raster(tmp_path / "one.tif")[0], predict_full(net, x))


def test_squeeze_excitation_run_refused_exact_and_approximate_said_so(tmp_path):
    torch.manual_seed(0)
    net = lively(SMPModel(**{k: v for k, v in SE.items() if k != "_target_"}))
    image = make_image(tmp_path / "scene.tif", height=421, width=389)
    exact = smp_run(tmp_path / "exact", SE, net, exact=False)
    (exact / "run_config.yaml").write_text(  # a run that claims exact tiling
        (exact / "run_config.yaml").read_text().replace("exact: false", "exact: true"))
    res = seg_predict_here(f"run={exact}", f"image={image}", f"output={tmp_path / 'x.tif'}",
                           "ckpt=last")
    assert res.returncode == 2 and "squeeze-excitation" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.tif").exists()

    run = smp_run(tmp_path / "approx", SE, net, exact=False)
    res = seg_predict_here(f"run={run}", f"image={image}", f"output={tmp_path / 'a.tif'}",
                           "ckpt=last", "fast=false", "tile_size=320")
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["exact"] is False and out["tiles"] > 1
    assert "tiling.exact=false" in res.stderr and "approximate" in res.stderr
    assert tiling_tag(tmp_path / "a.tif").startswith("approximate")
    labels = read_raster(tmp_path / "a.tif")[0]
    assert labels.shape == (421, 389) and np.unique(labels).size > 1
