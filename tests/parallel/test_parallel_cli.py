"""Lightning with pipelines and sample parallelism, through the real training command."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import warm
from helpers.cli import run_train

from seg_at_scale.io import read_raster
from seg_at_scale.models import UNet
from seg_at_scale.models.trained import load_run
from seg_at_scale.parallel.pipe import PipelineConfig, build_pipe
from seg_at_scale.tiling import predict_full, predict_tiled

TINY = ["logger=csv", "model=unet_tiny", "data.synthetic.height=157",
        "data.synthetic.width=189", "data.synthetic.splits={train:2,val:1,test:1}",
        "predict.tile_size=96", "predict.fast=false", "trainer.enable_progress_bar=false",
        "trainer.num_sanity_val_steps=0"]
SGD = ["task.optimizer._target_=torch.optim.SGD", "~task.optimizer.weight_decay",
       "task.optimizer.lr=0.05", "task.scheduler=null"]


def train(tmp: Path, run: str, *overrides: str) -> dict:
    return run_train(tmp, run, *TINY, *overrides)


def params(run: Path) -> dict[str, torch.Tensor]:
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    return {k: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}


def test_pipeline_manual_fits_checkpoints_resumes_and_predicts(tmp_path: Path) -> None:
    args = ["trainer=fast", "tiling.tile_size=96", "pipeline=manual", "pipeline.balance=[9,18]",
            "pipeline.chunks=2", "tiling.batch_size=3", "predict_after_fit=false"]
    first = train(tmp_path, "run", *args)
    assert "Pipe balance [9, 18]" in first["log"]
    saved = yaml.safe_load((tmp_path / "run" / "run_config.yaml").read_text())
    assert saved["computed"]["pipeline"]["balance"] == [9, 18]
    again = train(tmp_path, "run", *args, "trainer.max_epochs=2", "predict_after_fit=true")
    assert "Restoring states from the checkpoint" in again["log"]
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert (ckpt["epoch"], ckpt["global_step"]) == (2, 4)
    assert 0.0 <= again["test"][0]["miou"] <= 1.0


def test_pipeline_auto_records_a_measured_balance(tmp_path: Path) -> None:
    out = train(tmp_path, "run", "trainer=fast", "tiling.tile_size=96", "pipeline=auto",
                "pipeline.stages=3", "pipeline.chunks=2", "tiling.batch_size=2",
                "predict_after_fit=false")
    pipe = out["computed"]["pipeline"]
    assert len(pipe["balance"]) == 3 and sum(pipe["balance"]) == 27
    assert pipe["balance_by"] == "time" and f"Pipe balance {pipe['balance']}" in out["log"]


def test_bad_pipeline_is_refused_before_training(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "seg_at_scale.cli.train", *TINY, "trainer=fast",
           f"hydra.run.dir={tmp_path / 'run'}", "pipeline=manual", "pipeline.balance=[5,5]"]
    env = {"SEG_DATA_DIR": str(tmp_path / "data"), "PATH": "/usr/bin:/bin"}
    out = warm.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0
    assert "pipeline.balance=[5, 5] sums to 10, but the model has 27 layers" in out.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow  # make test-all; the property is also proven by faster tests
def test_two_process_ddp_training_equals_one_process(tmp_path: Path) -> None:
    """2 gloo ranks share each image's 9 tiles (uneven: 5 + 4); same steps, same weights."""
    common = ["tiling=grid", "tiling.q=3", "trainer.max_epochs=1", "predict_after_fit=false",
              *SGD]
    one = train(tmp_path, "one", *common)
    two = train(tmp_path, "two", *common, "trainer=ddp", "trainer.devices=2")
    a, b = params(tmp_path / "one"), params(tmp_path / "two")
    assert a.keys() == b.keys()
    init = UNet(4, 5, levels=3, convs_per_level=2, base_width=8, padding="same").state_dict()
    moved = max((a[k] - init[k.removeprefix("model.")]).abs().max() for k in a)
    assert moved > 1e-3  # the runs trained (from the same seeded initial weights)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
    assert two["val/miou"] == pytest.approx(one["val/miou"], abs=1e-4)


def test_ddp_validation_grid_with_fewer_tiles_than_ranks(tmp_path: Path) -> None:
    """q = 1: one validation tile for 2 ranks; rank 1 takes a pad slot instead of failing
    with "DataLoader within local rank has zero length" and a gloo error. Then rank 0
    predicts the test scene alone (the default ``predict_after_fit``): it failed with
    "Connection closed by peer" when its prediction still counted the finished rank 1."""
    summary = train(tmp_path, "run", "tiling=grid", "tiling.q=1", "trainer=ddp",
                    "trainer.devices=2", "trainer.max_epochs=1")
    assert summary["computed"]["grid"] == [1, 1]
    assert 0.0 <= summary["val/miou"] <= 1.0
    # the validation IoUs are every rank's already: logged without Lightning's warning
    assert "sync_dist=True" not in summary["log"], summary["log"][-2000:]
    # a new run: rank 1, started by Lightning into the folder rank 0 had written, said
    # "resuming the run in ... (same config)"
    assert "resuming the run" not in summary["log"], summary["log"][-3000:]
    # each rank's own memory line, named (two unnamed lines of different figures before)
    ranks = re.findall(r"memory=none precision=32-true \(rank (\d) of 2\): peak", summary["log"])
    assert sorted(ranks) == ["0", "1"], summary["log"][-3000:]
    test = summary["test"][0]  # the whole scene, tiled, from the best checkpoint
    trained = load_run(tmp_path / "run")
    image = next((tmp_path / "data").glob("*/test/scene_0_image.tif"))
    x = torch.from_numpy(trained.normalizer(read_raster(image)))[None]
    ref = predict_full(trained.model.eval(), x).argmax(1)[0].numpy()
    np.testing.assert_array_equal(read_raster(test["prediction"])[0], ref)


def test_whole_image_prediction_through_a_pipe() -> None:
    torch.manual_seed(0)
    net = UNet(3, 4, levels=3, convs_per_level=2, base_width=4, padding="valid").eval()
    image = torch.randn(1, 3, 197, 151)
    ref = predict_tiled(net, image, q=2)
    n = len(net.pipeline_layers())
    pipe = build_pipe(net, PipelineConfig([11, n - 11], ["cpu", "cpu"], chunks=1))
    out = predict_tiled(pipe, image, q=3, fp=net.footprint())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
