"""Run folders are append-only; your own TIFFs train and predict with no hand-set numbers;
the project's errors arrive as one line. Through the real ``seg-train`` command."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import warm
from helpers.cli import run_train, seg_train_here
from omegaconf import OmegaConf

from seg_at_scale.cli.common import reports_errors
from seg_at_scale.cli.runs import RunFolder
from seg_at_scale.errors import ConfigError
from seg_at_scale.io import write_raster
from seg_at_scale.models.trained import load_run

TINY = ["trainer=fast", "logger=csv", "model=unet_tiny", "data.synthetic.height=157",
        "data.synthetic.width=189", "data.synthetic.splits={train:2,val:1,test:1}",
        "tiling.tile_size=96", "predict.tile_size=96"]


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def seg_train(tmp: Path, *overrides: str, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "seg_at_scale.cli.train", *overrides]
    base = {"SEG_DATA_DIR": str(tmp / "data"), "PATH": "/usr/bin:/bin", "WANDB_MODE": "offline"}
    return warm.run(cmd, capture_output=True, text=True, env={**base, **(env or {})},
                    timeout=300)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[Path, Path]:
    """A finished tiny run (its data folder, the run folder), trained once for the module;
    the tests that share it refuse reruns into it, or copy it."""
    tmp = tmp_path_factory.mktemp("finished")
    run_train(tmp, "run", *TINY, "predict_after_fit=false")
    return tmp, tmp / "run"


def test_rerun_with_another_config_is_refused_and_changes_no_file(finished_run) -> None:
    tmp_path, run = finished_run
    before = snapshot(run)
    assert ".hydra/config.yaml" in before and "run_config.yaml" in before
    out = seg_train_here(tmp_path, *TINY, "predict_after_fit=false", "model=unet_small",
                         f"hydra.run.dir={run}")
    assert out.returncode == 2
    message = out.stderr.strip()
    assert message.startswith("seg-train: error: hydra.run.dir=") and "Traceback" not in message
    assert "model.base_width: 8 in the run, 16 now" in message
    assert "leave out hydra.run.dir" in message
    assert snapshot(run) == before  # bytes and mtimes: nothing rewritten, nothing added
    trained = load_run(run)  # seg-predict still loads the finished run
    assert trained.config.model.base_width == 8 and trained.model.num_classes == 5


def test_a_new_run_from_a_checkpoint_with_nothing_left_to_train_is_refused(finished_run,
                                                                           tmp_path) -> None:
    """Before: Lightning restored it and stopped at once; the new run trained nothing, saved
    no checkpoint and reported the other run's val/miou and checkpoint as its own."""
    data, run = finished_run
    ckpt = run / "checkpoints" / "last.ckpt"
    new = tmp_path / "new"
    out = seg_train_here(data, *TINY, "predict_after_fit=false", f"hydra.run.dir={new}",
                         f"ckpt_path={ckpt}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"seg-train: error: ckpt_path='{ckpt}' has trained 1 epoch, and trainer.max_epochs=1: "
        "nothing is left to train from it (the run would report that run's figures as its "
        "own); raise trainer.max_epochs above 1, or continue that run in its own folder")
    assert not new.exists()


def test_a_refused_rerun_into_a_moved_run_changes_no_file(finished_run, tmp_path) -> None:
    """Before: refused (good), but "the run was saved in ... and is now in ..." was first
    appended to the moved run's train.log; now that line waits until a rerun is accepted."""
    data, run = finished_run
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)  # bytes and mtimes kept: a moved (or copied) run
    before = snapshot(moved)
    assert "train.log" in before
    out = seg_train_here(data, *TINY, "predict_after_fit=false", "model=unet_small",
                         f"hydra.run.dir={moved}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "holds a run with another config" in out.stderr
    assert snapshot(moved) == before  # train.log too: nothing appended
    assert "is now in" not in (moved / "train.log").read_text()


@pytest.mark.parametrize("key, value, named", [
    ("data.mean", [0.25, 0.5, 0.5, 0.5], "data.normalization.mean"),
    ("data.class_names", ["water", "background", "vegetation", "road", "building"],
     "data.class_names"),
])
def test_a_checkpoint_of_a_run_with_other_classes_or_normalisation_is_refused(
        finished_run, tmp_path, key, value, named) -> None:
    """Before: a checkpoint with the same shapes predicted silently under the other run's
    classes and normalisation (wrong labels, no word)."""
    from seg_at_scale.errors import InputError
    from seg_at_scale.models.checkpoint import load_checkpoint
    from seg_at_scale.models.trained import MEANING_KEY, weights_meaning

    _, run = finished_run
    saved = load_checkpoint(run / "checkpoints" / "last.ckpt")[MEANING_KEY]
    assert saved == weights_meaning(OmegaConf.load(run / "run_config.yaml"))
    other = tmp_path / "other"  # another run: same network, other data keys
    shutil.copytree(run, other)
    cfg = OmegaConf.load(other / "run_config.yaml")
    OmegaConf.update(cfg, key, value)
    OmegaConf.save(cfg, other / "run_config.yaml")
    for ckpt in ("last", str(run / "checkpoints" / "last.ckpt")):
        with pytest.raises(InputError, match=rf"was trained with other keys than the run's "
                                             rf"config: {re.escape(named)}: .* in the "
                                             r"checkpoint, .* in the config\. The checkpoint "
                                             r"is another run's"):
            load_run(other, ckpt)
    assert load_run(run, "last").card.class_names[0] == "background"


def test_a_checkpoint_of_nan_weights_is_refused_naming_the_divergence(finished_run, tmp_path):
    """Before: a diverged run's NaN weights loaded, exported and predicted class 0 for every
    pixel, exit 0."""
    import torch

    from seg_at_scale.errors import InputError

    _, run = finished_run
    data = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    key = next(k for k, v in data["state_dict"].items() if v.is_floating_point())
    data["state_dict"][key] = torch.full_like(data["state_dict"][key], float("nan"))
    torch.save(data, tmp_path / "nan.ckpt")
    with pytest.raises(InputError, match=r"checkpoint '.*nan\.ckpt': the weights hold NaN or "
                                         r"infinite values in 1 of the \d+ float tensors \(first "
                                         + re.escape(key.removeprefix("model.")) + r": \d+ of \d+ "
                                         r"values\): the "
                                         r"training diverged \(a loss of nan\); use a "
                                         r"checkpoint from before it"):
        load_run(run, str(tmp_path / "nan.ckpt"))


def test_a_cards_scores_are_those_of_its_checkpoint(finished_run, tmp_path):
    """Before: ``seg-export ckpt=last`` wrote the best checkpoint's val/miou (and the test
    scenes' mIoU, predicted with the best) into the card of the last checkpoint."""
    import torch

    _, run = finished_run
    other = tmp_path / "run"
    shutil.copytree(run, other)
    best = next(p for p in (other / "checkpoints").glob("epoch*.ckpt"))
    data = torch.load(other / "checkpoints" / "last.ckpt", weights_only=True)
    (state,) = [v for v in data["callbacks"].values() if "best_model_score" in v]
    state["current_score"] = torch.tensor(0.0123)  # a later, worse epoch than the best
    torch.save(data, other / "checkpoints" / "last.ckpt")
    summary = json.loads((other / "summary.json").read_text())
    summary.update({"checkpoint": str(run / "checkpoints" / best.name), "val/miou": 0.9,
                    "test": [{"miou": 0.8}]})
    (other / "summary.json").write_text(json.dumps(summary))
    last = load_run(other, "last").card.metrics
    assert last == {"val/miou": 0.0123, "checkpoint/best_score": round(float(
        state["best_model_score"]), 6)}
    kept = load_run(other, best.name).card.metrics
    assert kept["test/miou"] == [0.8] and kept["val/miou"] == kept["checkpoint/best_score"]


def write_uint16_scenes(root: Path) -> None:
    """Sentinel-like 4-band uint16 scenes (0..~6000) whose labels follow band 0."""
    rng = np.random.default_rng(0)
    for split, n in {"train": 2, "val": 1, "test": 1}.items():
        (root / split).mkdir(parents=True)
        for k in range(n):
            image = rng.normal(2000, 600, (4, 120, 136)).clip(0, 6000).astype(np.uint16)
            labels = np.digitize(image[0], [1500, 2000, 2500]).astype(np.uint8)
            write_raster(root / split / f"s{k}_image.tif", image, tile=(64, 64))
            write_raster(root / split / f"s{k}_mask.tif", labels, tile=(64, 64))


def test_readme_own_tiffs_command_trains_predicts_and_saves_its_numbers(tmp_path: Path) -> None:
    root = tmp_path / "scenes"
    write_uint16_scenes(root)
    summary = run_train(tmp_path, "run", "data=tiff", f"data.root={root}", "data.bands=4",
                        "data.num_classes=4", "data.num_workers=0", "trainer=fast", "logger=csv",
                        "model=unet_tiny", "tiling.tile_size=96", "predict.tile_size=96")
    assert 0.0 <= summary["test"][0]["miou"] <= 1.0  # no class names given: class_k
    saved = yaml.safe_load((tmp_path / "run" / "run_config.yaml").read_text())
    assert saved["data"]["class_names"] == ["class_0", "class_1", "class_2", "class_3"]
    norm = saved["computed"]["normalization"]
    assert norm["dtype"] == "uint16" and 1 / 4000 < norm["scale"] < 1 / 2000
    assert all(0.3 < m < 0.9 for m in norm["mean"]) and all(0.05 < s < 0.3 for s in norm["std"])
    assert saved["computed"]["filled"]["data.scale"] == "auto"
    n = load_run(tmp_path / "run").normalizer  # what seg-predict normalises with
    assert (n.scale, list(n.mean), list(n.std)) == (norm["scale"], norm["mean"], norm["std"])
    assert "test scene s0:\n  class_0" in summary["log"]


def test_project_errors_print_alone_unless_hydra_full_error(monkeypatch, capsys) -> None:
    @reports_errors("seg-x")
    def fails() -> None:
        raise ConfigError("tiling.q='abc': give a whole number")

    with pytest.raises(SystemExit) as exit_:
        fails()
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "seg-x: error: tiling.q='abc': give a whole number\n"
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ConfigError):
        fails()


def test_bad_tiling_value_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = seg_train_here(tmp_path, *TINY, "tiling.q=abc", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "seg-train: error: tiling.q='abc': give the tiles per side as a whole number >= 1 (1 = "
        "the whole image in one tile), [rows, cols] of such numbers, or tiling.q=null with "
        "tiling.tile_size=<pixels>"]
    full = seg_train(tmp_path, *TINY, "tiling.q=abc", f"hydra.run.dir={tmp_path / 'run'}",
                     env={"HYDRA_FULL_ERROR": "1"})
    assert full.returncode == 1 and "Traceback" in full.stderr and "ConfigError" in full.stderr


@pytest.mark.parametrize(("override", "expected"), [
    ("hydra.run.dir=s3://bucket/runs/a", "hydra.run.dir='s3://bucket/runs/a' is a URL (s3:)"),
    # a /vsi path would be made at the file system's root: a URL is made here, in tmp_path
    ("hydra.sweep.dir=gs://bucket/sweep", "hydra.sweep.dir='gs://bucket/sweep' is a URL (gs:)"),
])
def test_a_run_or_sweep_folder_that_is_a_url_is_refused_before_it_is_made(tmp_path, monkeypatch,
                                                                         override, expected):
    """Before: Hydra made a local folder 's3:/bucket/runs/a' and the run wrote into it."""
    monkeypatch.chdir(tmp_path)
    multirun = ["-m"] if override.startswith("hydra.sweep") else []
    out = seg_train_here(tmp_path, *multirun, *TINY, override)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"seg-train: error: {expected}: seg_at_scale reads and writes local files only (outputs "
        "are written under temporary names and renamed when complete); write to a local or "
        "mounted folder, then copy the result there (aws s3 cp, gsutil cp, rclone copy)"]
    assert sorted(tmp_path.iterdir()) == []  # no 's3:' folder, no data, no train.log


@pytest.mark.parametrize(("override", "hint"), [
    ("modl=unet_tiny", " (did you mean model=?)"),
    ("trainr.max_epochs=1", " (did you mean trainer.max_epochs=?)"),
    ("modl/x=y", " (did you mean model/x=?)"),
    # before: lr= had no hint, and optimizer.lr= was told optimized_metric.lr= (a name alike)
    ("lr=0.1", " (did you mean task.optimizer.lr=?)"),
    ("optimizer.lr=0.01", " (did you mean task.optimizer.lr=?)"),
    ("no_such.thing=1", "")])
def test_a_mistyped_top_level_key_is_named_before_hydra(tmp_path, override, hint):
    """Before: Hydra answered ``modl=unet_tiny`` with "Could not override 'modl'. To append
    to your config use +modl=unet_tiny" and a trace."""
    out = seg_train_here(tmp_path, *TINY, override, f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    key = override.split("=")[0]
    assert len(lines) == 1 and lines[0].startswith(
        f"seg-train: error: {key}= is not a seg-train key or group{hint}; the top-level keys "
        "and groups are callbacks, ckpt_path, data, experiment, finetune, hparams_search, "
        "hydra, logger, memory, model, model_family, optimized_metric, pipeline, "), lines
    assert sorted(tmp_path.iterdir()) == []
    shown = seg_train_here(tmp_path, "--cfg", "job", *TINY)  # Hydra's flags are not keys
    assert shown.returncode == 0 and "height: 157" in shown.stdout, shown.stderr[-2000:]


@pytest.mark.parametrize(("override", "expected"), [
    ("trainer.max_epoch=2", "trainer.max_epoch= is not a key of trainer (did you mean "
     "trainer.max_epochs=?); its keys are _target_, accelerator, check_val_every_n_epoch, "),
    ("data.synthetic.splits.tran=3", "data.synthetic.splits.tran= is not a key of "
     "data.synthetic.splits (did you mean data.synthetic.splits.train=?); its keys are test, "
     "train, val. A key it does not have yet is added with +data.synthetic.splits.tran="),
    ("logger.offline=false", "logger.offline= is not a key of logger; its keys are csv. A key "
     "it does not have yet is added with +logger.offline="),
    ("seed.x=1", "seed.x= sets a key below seed, which is a value, not a group of keys; set "
     "seed= itself"),
    # before: "optimized_metric.lr= is not a key of ; its keys are ..."
    ("optimized_metric.lr=0.01", "optimized_metric.lr= is not a key of the config these "
     "groups compose (optimized_metric is not in it); its top-level keys are callbacks, "),
    ("precision=bf17", "precision=bf17 is not an option of the precision group (did you mean "
     "precision=bf16?); its options are 16, 16-mixed, 32, 32-true, bf16, bf16-mixed "
     "(seg_at_scale/conf/precision/)"),
    # before: Hydra's "Config group override must be a string or a list. Got int", a trace
    ("precision=16", "precision=16 reads 16 as a number, and a group's option is a name: "
     "quote it (precision=\"'16'\") or give the option's full name; the precision group's "
     "options are 16, 16-mixed, 32, 32-true, bf16, bf16-mixed"),
    ("logger=true", "logger=true reads true as a boolean, and a group's option is a name: the "
     "logger group's options are csv, none, wandb"),
])
def test_a_mistyped_key_of_a_group_or_option_is_named_before_hydra(tmp_path, override,
                                                                    expected):
    """Before: Hydra answered ``trainer.max_epoch=2`` with "Could not override ... To append
    to your config use +trainer.max_epoch=2" and a trace (``precision=bf17``: its config
    search path)."""
    out = seg_train_here(tmp_path, *TINY, override, f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"seg-train: error: {expected}"), lines
    assert sorted(tmp_path.iterdir()) == []


def test_a_key_of_an_open_group_names_how_to_add_it(tmp_path):
    """Before: "model.options.decoder_chanels= is not a key of model.options; its keys are
    ." (model.options holds smp's keywords, none by default)."""
    out = seg_train_here(tmp_path, *TINY, "model=smp", "model.options.decoder_chanels=[8]",
                         f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "seg-train: error: model.options.decoder_chanels= is not a key of model.options, which "
        "holds none yet: add it with +model.options.decoder_chanels= (it is then checked where "
        "it is used)"]
    assert sorted(tmp_path.iterdir()) == []


@pytest.mark.parametrize("overrides", [
    # set by the precision group into trainer, by a file the option extends, by a family
    ["trainer=fast", "trainer.precision=bf16-mixed", "trainer.limit_val_batches=1",
     "model=unet_tiny", "model.in_channels=4", "data.synthetic.splits.train=3"],
    ["experiment=unet2015", "model.base_width=8", "+trainer.gradient_clip_val=1.0"],
    ["-m", "model=unet_tiny,gscnn_tiny", "model.whatever_a_sweep_has=1"],  # left to Hydra
    ["--config-dir", "mine", "mygroup.key=1"],  # the user's groups are not known here
])
def test_keys_the_composed_config_has_pass_the_precheck(overrides):
    from seg_at_scale.cli.overrides import precheck, train_top_keys

    top = [*train_top_keys(), "mygroup"]
    assert precheck("seg-train", None, overrides, top=top) is None


@pytest.mark.parametrize(("override", "hint"), [("+modl=unet_tiny", " (did you mean model=?)"),
                                               ("+lr=0.1", ""), ("+optim.lr=0.1", "")])
def test_a_top_level_key_added_with_plus_that_nothing_reads_is_refused(tmp_path, override,
                                                                      hint):
    """Before: Hydra's advice for the typo ``modl=unet_tiny`` ("use +modl=unet_tiny"), taken,
    trained the default model without a word."""
    out = seg_train_here(tmp_path, *TINY, override, "++seed=3", "+predict.tta=null",
                         "+callbacks.lr2._target_=pytorch_lightning.callbacks.LearningRateMonitor",
                         f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2
    key = override[1:].split("=")[0].split(".")[0]
    assert out.stderr.strip().splitlines() == [
        f"seg-train: error: +{key}= adds a key that no part of seg-train reads{hint}; the "
        "top-level keys and groups are callbacks, ckpt_path, data, experiment, finetune, "
        "hparams_search, logger, memory, model, pipeline, precision, predict, "
        "predict_after_fit, run_name, seed, slurm, task, tiling, trainer, trust_run"]
    assert not (tmp_path / "data").exists()  # refused before the scenes were written


def test_a_refused_run_leaves_no_folder_and_an_existing_one_as_it_was(tmp_path, monkeypatch):
    """Before: every refused seg-train left runs/<name>/<date>/train.log behind."""
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    for where in ([], ["hydra.run.dir=new/deeper/run"], [f"hydra.run.dir={mine}"]):
        out = seg_train_here(tmp_path, *TINY, "model.in_channels=9", *where)
        assert out.returncode == 2 and "model.in_channels=9 but data.bands=4" in out.stderr
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    # nothing written: Hydra's log of the refused command is removed from the user's folder
    assert left == ["mine", "mine/notes.txt"]


def test_filled_values_are_reused_on_resume_and_their_requests_compared(tmp_path: Path) -> None:
    def config(scale: object, epochs: int):  # type: ignore[no-untyped-def]
        return OmegaConf.create({"data": {"scale": scale}, "task": {"scale": "${data.scale}"},
                                 "trainer": {"max_epochs": epochs}})

    cfg = config("auto", 1)
    run = RunFolder.open(tmp_path, cfg)
    assert not run.resuming and run.fill(cfg, "data.scale", lambda: 0.25) == 0.25
    run.save(cfg, {"halo": 3})
    saved = yaml.safe_load((tmp_path / "run_config.yaml").read_text())
    assert saved["task"]["scale"] == 0.25 and saved["computed"]["filled"] == {"data.scale": "auto"}
    assert yaml.safe_load((tmp_path / ".hydra" / "config.yaml").read_text())["data"] == {
        "scale": "auto"}  # what was asked

    again = config("auto", 5)  # more epochs: a resume, with the saved number
    resumed = RunFolder.open(tmp_path, again)
    assert resumed.resuming and again.task.scale == 0.25
    assert resumed.fill(again, "data.scale", lambda: pytest.fail("worked out again")) == 0.25
    resumed.save(again, {})
    assert yaml.safe_load((tmp_path / "run_config.yaml").read_text()) == saved
    assert (tmp_path / ".hydra" / "resume_1" / "config.yaml").exists()
    with pytest.raises(ConfigError, match=r"data.scale: 'auto' in the run, 0.5 now"):
        RunFolder.open(tmp_path, config(0.5, 1))


def test_a_bad_value_in_a_sweep_is_refused_before_the_first_trial(tmp_path):
    """Before: ``-m tiling.batch_size=2,0,4`` trained trial 0 to the end, then the sweep
    stopped on trial 1's refusal (and trial 2 never ran)."""
    sweep = tmp_path / "sweep"
    out = seg_train_here(tmp_path, "-m", *TINY, "tiling.batch_size=2,0,4",
                         "task.optimizer.lr=0.01,0.02", f"hydra.sweep.dir={sweep}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "seg-train: error: the sweep's tiling.batch_size=2,0,4: tiling.batch_size=0: give "
        "tiles per batch as a whole number >= 1 (the trial of tiling.batch_size=0); no trial "
        "was run"]
    assert not sweep.exists() and not (tmp_path / "data").exists()
    out = seg_train_here(tmp_path, "-m", *TINY, "task.optimizer.lr=0.01,-1",
                         f"hydra.sweep.dir={sweep}")
    assert out.returncode == 2 and "the sweep's task.optimizer.lr=0.01,-1: " \
        "task.optimizer.lr=-1 must be above 0" in out.stderr, out.stderr[-2000:]


def test_the_values_of_a_good_sweep_pass_its_check():
    from seg_at_scale.cli.train import check_sweep

    assert check_sweep(["-m", "model=unet_tiny,unet_small", "tiling.batch_size=2,4",
                        "task.optimizer.lr=range(1,3)", "seed=0,1", "data.num_workers=0"]) is None
    assert check_sweep(["tiling.batch_size=0"]) is None  # not a sweep: the run checks it
