"""End to end: seg-train experiment=finetune on an smp preset, then seg-predict of its run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from helpers.cli import run_train
from helpers.prediction import seg_predict
from omegaconf import OmegaConf
from safetensors.torch import save_file

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.io import read_raster
from seg_at_scale.models.registry import build_model
from seg_at_scale.tiling import predict_full

IMAGENET = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
TINY = ["trainer=fast", "logger=csv", "data.synthetic.height=157", "data.synthetic.width=189",
        "data.synthetic.splits={train:2,val:1,test:1}", "tiling.q=1", "trainer.max_epochs=2",
        "predict.tile_size=352"]


def pretrained_file(tmp: Path) -> Path:
    """timm's test_resnet with its ImageNet statistics in the safetensors header."""
    torch.manual_seed(0)
    path = tmp / "test_resnet.safetensors"
    save_file(timm.create_model("test_resnet").state_dict(), path,
              metadata={k: json.dumps(v) for k, v in IMAGENET.items()})
    return path


def test_finetune_train_then_predict_its_run(tmp_path):
    weights = pretrained_file(tmp_path)
    summary = run_train(tmp_path, "run", "experiment=finetune", "model=unet_test_resnet",
                        f"model.encoder_weights={weights}", *TINY, timeout=400)
    run = tmp_path / "run"
    cfg = OmegaConf.load(run / "run_config.yaml")
    assert list(cfg.data.mean) == [*IMAGENET["mean"], 0.5]  # the weights', band 4 the data's
    assert cfg.computed.halo == 147 and cfg.computed.align == 32
    assert "90 tensors loaded, 0 missing" in summary["log"]
    assert 0.0 <= summary["test"][0]["miou"] <= 1.0
    image = next((tmp_path / "data").glob("*/test/scene_0_image.tif"))
    res = seg_predict(run, image, tmp_path / "pred.tif", "fast=false", "q=2")
    assert res["tiles"] > 1
    model = build_model(OmegaConf.to_container(cfg.model, resolve=True), where="test").eval()
    state = torch.load(res["checkpoint"], map_location="cpu", weights_only=True)["state_dict"]
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()
                           if k.startswith("model.")})
    norm = Normalizer(float(cfg.data.scale), tuple(cfg.data.mean), tuple(cfg.data.std))
    ref = predict_full(model, torch.from_numpy(norm(read_raster(image)))[None])
    top2 = ref.topk(2, dim=1).values[0]
    decided = ((top2[0] - top2[1]) > 1e-5 * ref.abs().max()).numpy()
    pred = read_raster(tmp_path / "pred.tif")[0]
    np.testing.assert_array_equal(pred[decided], ref.argmax(1)[0].numpy()[decided])
    # the same run stage by stage (seg-predict staged=true): the same labels
    staged = seg_predict(run, image, tmp_path / "staged.tif", "fast=false", "q=2",
                         "staged=true", "stage_memory_mb=1")
    assert staged["tiles"] == res["tiles"]
    pred = read_raster(tmp_path / "staged.tif")[0]
    np.testing.assert_array_equal(pred[decided], ref.argmax(1)[0].numpy()[decided])


@pytest.mark.slow
def test_unet_resnet34_trains_and_predicts(tmp_path):
    """The preset users reach for (halo 513: tiles of at least 1120 pixels); minutes on CPU."""
    summary = run_train(tmp_path, "run", "model=unet_resnet34", "trainer=fast", "logger=csv",
                        "data.synthetic.height=600", "data.synthetic.width=560",
                        "data.synthetic.splits={train:1,val:1,test:1}", "tiling=grid",
                        "tiling.q=1", "trainer.max_epochs=1", "predict.tile_size=1152",
                        timeout=3000)
    assert summary["computed"]["halo"] == 513
    image = next((tmp_path / "data").glob("*/test/scene_0_image.tif"))
    res = seg_predict(tmp_path / "run", image, tmp_path / "pred.tif", "fast=false",
                      "tile_size=1152", timeout=1200)
    assert read_raster(tmp_path / "pred.tif").shape == (1, 600, 560) and res["halo"] == 513
