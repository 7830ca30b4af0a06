"""The Hydra entry points on tiny configs: compose, train, resume, predict, refuse."""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import warm
from helpers.cli import CONF, TINY, run_train
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from pytorch_lightning.utilities.model_summary.model_summary import get_human_readable_count

from seg_at_scale.cli.predict import run_prediction
from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.errors import OutputExistsError
from seg_at_scale.io import RasterReader, read_raster
from seg_at_scale.models.trained import load_run
from seg_at_scale.tiling import predict_full

CONF_PATH = Path(CONF)
# U-Net experiments; those of other model families (an `override /model:` line, e.g. the
# cosmic UResNet ones) are composed and run by their own tests with their own tiny sizes.
EXPERIMENTS = sorted(p.stem for p in (Path(CONF) / "experiment").glob("*.yaml")
                     if "override /model:" not in p.read_text())


def train(tmp: Path, run: str, *overrides: str) -> dict:
    return run_train(tmp, run, *TINY, *overrides, timeout=300)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment):
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={experiment}", *TINY],
                      return_hydra_config=True)
    assert cfg.model._target_ == "seg_at_scale.models.UNet"
    assert cfg.task.num_classes == cfg.data.num_classes == cfg.model.num_classes


@pytest.mark.parametrize("experiment, q, name", [
    ("exact_grid", "2", "exact_grid_q2"), ("exact_grid", "[1,4]", "exact_grid_q1x4"),
    ("summit_like", "[3,2]", "summit_like_q3x2")])
def test_tiles_per_side_of_each_axis_name_the_run_in_one_folder(experiment, q, name):
    """``tiling.q=[rows,cols]`` gives the run's folder ``..._q1x4``, not ``..._q[1, 4]``."""
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={experiment}", *TINY, f"tiling.q={q}"],
                      return_hydra_config=True)
    assert cfg.run_name == name


def test_train_saves_computed_halo_and_predicts_test_scene(tmp_path):
    summary = train(tmp_path, "run")
    run = tmp_path / "run"
    saved = (run / "run_config.yaml").read_text()
    assert "halo: 22" in saved and "efficiency:" in saved  # tiny same U-Net: halo 22
    test = summary["test"][0]
    assert 0.0 <= test["miou"] <= 1.0 and Path(test["preview"]).exists()
    with RasterReader(test["prediction"]) as r:
        assert (r.height, r.width) == (157, 189) and not r.geotags.is_empty
    # the memory line, once: Hydra's console shows its log record (it was printed too)
    assert summary["log"].count("memory=none precision=32-true: peak") == 1


def test_prediction_file_equals_untiled_model(tmp_path):
    train(tmp_path, "run", "predict_after_fit=false")
    image = next((tmp_path / "data").glob("*/test/scene_0_image.tif"))
    cfg = _predict_cfg(tmp_path / "run", image, tmp_path / "pred.tif", "fast=false",
                       "tile_size=64")
    res = run_prediction(cfg)
    model = load_run(tmp_path / "run").model
    x = torch.from_numpy(Normalizer(1 / 255, (0.5,), (0.25,))(read_raster(image)))[None]
    ref = predict_full(model, x).argmax(1)[0].numpy()
    assert res["tiles"] > 4
    np.testing.assert_array_equal(read_raster(tmp_path / "pred.tif")[0], ref)
    again = run_prediction(cfg)  # the same command: its finished output is recognised
    assert again["tiles_computed"] == 0 and again["tiles_resumed"] == res["tiles"]
    other = _predict_cfg(tmp_path / "run", image, tmp_path / "pred.tif", "fast=false",
                         "tile_size=96")
    with pytest.raises(OutputExistsError, match="made by another prediction.*overwrite=true"):
        run_prediction(other)


def test_interrupted_run_resumes_from_last_checkpoint(tmp_path):
    first = train(tmp_path, "run", "predict_after_fit=false")
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()
    again = train(tmp_path, "run", "predict_after_fit=false", "trainer.max_epochs=2")
    assert "Restoring states from the checkpoint" in again["log"]
    assert f"resuming the run in {tmp_path / 'run'} (same config)" in again["log"]
    assert "resuming the run" not in first["log"]
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert first["val/miou"] is not None
    assert (ckpt["epoch"], ckpt["global_step"]) == (2, 4)  # epoch 2 ran on top of epoch 1


def test_exact_grid_training_runs_and_multirun_sweeps(tmp_path):
    """With a path among the overrides (``data.root=/scenes``, as the README's sweep of a
    user's scenes): before, its slashes made each job a tree of folders named after the
    path, and the sweep report found no job. ``tiling.q=[1,2]``: rows and columns apart.
    With the default logger (wandb), each job has its own wandb run: before, the second
    found the first's still open and logged into it ("There is a wandb run already in
    progress"), and the first's closing lines came with raw colour codes."""
    root = tmp_path / "data" / "mine"
    tiny = [o for o in TINY if not o.startswith("logger=")]
    cmd = [sys.executable, "-m", "seg_at_scale.cli.train", "-m", *tiny, "tiling=grid",
           "tiling.q=1,[1,2]", "trainer.limit_train_batches=4", "predict_after_fit=false",
           f"hydra.sweep.dir={tmp_path / 'sweep'}",
           f"data.root={root}"]
    env = {"SEG_DATA_DIR": str(tmp_path / "data"), "PATH": "/usr/bin:/bin",
           "WANDB_MODE": "offline"}
    out = warm.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stdout + out.stderr
    assert "already in progress" not in log and "\x1b[" not in log, log[-3000:]
    assert (root / "train").is_dir()
    jobs = sorted(p for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert [p.name[:2] for p in jobs] == ["0_", "1_"] and "_tmp_" in jobs[0].name
    summaries = sorted((tmp_path / "sweep").glob("*/summary.json"))
    assert len(summaries) == 2
    with open(tmp_path / "sweep" / "sweep_report.csv") as fh:
        assert len(list(csv.DictReader(fh))) == 2
    computed = [json.loads(p.read_text())["computed"] for p in summaries]
    assert [c["grid"] for c in computed] == [[1, 1], [1, 2]]
    assert computed[0]["efficiency"] < computed[1]["efficiency"]  # 2 tiles: more halo
    for job, grid in zip(jobs, (b'"grid":[1,1]', b'"grid":[1,2]'), strict=True):
        (wandb_run,) = (job / "wandb").glob("offline-run-*")  # its own, in its folder
        record = b"".join(p.read_bytes() for p in wandb_run.glob("run-*.wandb"))
        assert grid in record  # the job's own hyperparameters
        # named after its job (every trial was "same_unet_tiny"), in its sweep's group (the
        # run record's run_group, protobuf field 6: tag 0x32, then the length)
        assert f"same_unet_tiny/{job.name}".encode() in record
        assert b"\x32\x05sweep" in record


def _predict_cfg(run: Path, image: Path, output: Path, *extra: str):
    with initialize_config_dir(str(CONF_PATH.with_name("conf_predict")), version_base="1.3"):
        return compose("predict", overrides=[f"run={run}", f"image={image}",
                                             f"output={output}", "preview=false", *extra])


@pytest.mark.slow  # make test-all; the property is also proven by faster tests
def test_notebook_runs_on_a_tiny_run(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    train(tmp_path, "run")
    nb = nbformat.read(Path(__file__).resolve().parents[2] / "notebooks" /
                       "visualize_predictions.ipynb", as_version=4)
    monkeypatch.setenv("SEG_RUN", str(tmp_path / "run"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    NotebookClient(nb, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []))
    assert "mIoU" in text and "efficiency E =" in text  # the asserts inside passed too


def test_hparams_search_composes_a_sweep_on_val_miou():
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=["hparams_search=lr_sweep", *TINY],
                      return_hydra_config=True)
    assert cfg.optimized_metric == "val/miou"
    assert cfg.callbacks.model_checkpoint.monitor == cfg.optimized_metric
    assert "task.optimizer.lr" in cfg.hydra.sweeper.params


@pytest.mark.parametrize("model", ["gscnn_large", "uresnet_pipe_small", "unet_wide"])
def test_a_size_of_another_family_fails_at_composition_listing_the_models(model):
    """A model is ``<family>_<size>``: a wrong pairing cannot compose, and Hydra lists the
    models there are."""
    from hydra.errors import MissingConfigException

    with initialize_config_dir(CONF, version_base="1.3"), \
            pytest.raises(MissingConfigException) as err:
        compose("train", overrides=[f"model={model}"])
    message = str(err.value)
    assert f"Could not find 'model/{model}'" in message
    listed = message.split("Available options in 'model':")[1].split()
    assert {"unet_small", "gscnn_wide", "uresnet_cosmic"} <= set(listed)
    assert model not in listed


def test_each_model_composes_into_its_own_family():
    """Every ``conf/model/*.yaml`` composes and builds the network of the family its
    defaults list names (``/model_family@_here_: <family>``)."""

    from seg_at_scale.models import GSCNN, SMPModel, UNet, UResNet

    family = {"unet": UNet, "gscnn": GSCNN, "uresnet": UResNet, "smp": SMPModel}
    models = sorted((CONF_PATH / "model").glob("*.yaml"))
    assert len(models) == 23
    with initialize_config_dir(CONF, version_base="1.3"):
        for path in models:
            if path.stem in ("unet_pipe_large", "gscnn_wide"):  # hundreds of MB of weights
                continue
            cfg = compose("train", overrides=[f"model={path.stem}"])
            assert "defaults" not in cfg.model
            with torch.device("meta"):  # the modules, without allocating or drawing weights
                net = instantiate(cfg.model)
            named = re.search(r"/model_family@_here_: (\w+)", path.read_text()).group(1)
            assert isinstance(net, family[named]), path.stem


def test_the_summary_names_the_kept_checkpoints_score_and_the_last_epochs(tmp_path):
    """Before: the summary's val/miou was the last epoch's, beside the best checkpoint it
    named (and predicted the test scenes with)."""
    summary = train(tmp_path, "run", "predict_after_fit=false", "trainer.max_epochs=4",
                    "task.optimizer.lr=0.2",  # a rate the last epoch does worse with
                    "trainer.enable_progress_bar=true")
    with open(tmp_path / "run" / "csv" / "version_0" / "metrics.csv") as fh:
        history = [float(m["val/miou"]) for m in csv.DictReader(fh) if m["val/miou"]]
    assert len(history) == 4 and max(history) > history[-1]
    assert summary["val/miou"] == pytest.approx(max(history), abs=1e-6)
    assert summary["val/miou_last"] == pytest.approx(history[-1], abs=1e-6)
    assert f"miou{max(history):.4f}" in summary["checkpoint"]
    # no terminal here (the output is a pipe, as in a Slurm job's file): a line per epoch
    # with the bar's figures, not a bar that shows nothing until the run ends
    lines = re.findall(r"epoch (\d+)/4 \((\d+) steps, [\d.]+ s\): .*val/miou ([\d.]+)",
                       summary["log"])
    assert [int(e) for e, _, _ in lines] == [1, 2, 3, 4]
    assert [float(m) for _, _, m in lines] == [round(h, 4) for h in history]
    assert all(int(n) > 0 for _, n, _ in lines)
    assert not re.search(r"Epoch \d+/\d+", summary["log"])  # the bar's own words
    train_log = (tmp_path / "run" / "train.log").read_text()
    assert len(re.findall(r"epoch \d+/4 \(", train_log)) == 4
    # the model's table, in the log too, without the FLOPs Lightning never counted here (it
    # printed a FLOPs column of 0 and "Total FLOPs: 0"); its count is the network's
    weights = torch.load(summary["checkpoint"], map_location="cpu", weights_only=True)
    params = sum(t.numel() for k, t in weights["state_dict"].items()
                 if k.startswith("model.") and not k.rsplit(".", 1)[1].startswith(
                     ("running_", "num_batches")))
    said = f"model: {get_human_readable_count(params).strip()} parameters ("
    assert said in summary["log"] and said in train_log
    assert re.search(r"\n +model +UNet +\S+ K +train\n", train_log)
    assert "FLOPs" not in summary["log"] + train_log
    # the same command again has no epoch left to fit: the same figures (val/miou_last was
    # null: no validation ran), from the run's record
    again = train(tmp_path, "run", "predict_after_fit=false", "trainer.max_epochs=4",
                  "task.optimizer.lr=0.2")
    assert (again["val/miou"], again["val/miou_last"]) == (summary["val/miou"],
                                                            summary["val/miou_last"])
