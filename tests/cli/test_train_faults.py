"""seg-train's run folders under faults: lost checkpoints, two runs at once, a moved folder.

Before: a run whose last.ckpt was deleted trained again from scratch while logging
"resuming"; a truncated last.ckpt gave a raw EOFError and added a .hydra/resume_k each
try; two seg-train into one folder both ran (last-v1.ckpt, two CSV versions); a copied or
moved run folder could never be resumed; a model for 3 bands on 4-band data died in its
first step with torch's channel error; a hub name on a machine whose name lookups never
answer took minutes to refuse.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import warm
from helpers.cli import run_here, run_train, seg_train_here
from omegaconf import OmegaConf

from seg_at_scale.data.config import data_config
from seg_at_scale.errors import ConfigError

TINY = ["trainer=fast", "logger=csv", "model=unet_tiny", "data.synthetic.height=97",
        "data.synthetic.width=101", "data.synthetic.splits={train:1,val:1,test:1}",
        "tiling.tile_size=64", "predict_after_fit=false"]


def _cmd(run: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "seg_at_scale.cli.train", f"hydra.run.dir={run}", *TINY,
            *overrides]


def _env(tmp: Path) -> dict[str, str]:
    return {"SEG_DATA_DIR": str(tmp / "data"), "PATH": "/usr/bin:/bin", "WANDB_MODE": "offline",
            "OMP_NUM_THREADS": "1", "CI": "true"}


def _train(tmp: Path, run: Path, *overrides: str) -> subprocess.CompletedProcess:
    return warm.run(_cmd(run, *overrides), capture_output=True, text=True,
                    env=_env(tmp), timeout=300)


def _epoch(path: Path) -> int:
    return int(torch.load(path, weights_only=True)["epoch"])


def _step(path: Path) -> int:
    return int(torch.load(path, weights_only=True)["global_step"])


def test_resume_takes_the_newest_checkpoint_that_loads_or_refuses_naming_what_is_missing(
        tmp_path):
    run_train(tmp_path, "run", *TINY)
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    last = ckpts / "last.ckpt"
    best = next(p for p in ckpts.glob("*.ckpt") if p.name != "last.ckpt")
    last.write_bytes(last.read_bytes()[:1000])  # cut off while being copied
    out = _train(tmp_path, run, "trainer.max_epochs=2")
    assert out.returncode == 0, out.stderr[-2000:]
    log = out.stdout + out.stderr
    assert f"checkpoint '{last}' cannot be read" in log  # skipped, named
    # with seg-train's key (it named seg-predict's ckpt=last, which seg-train refuses)
    assert "(ckpt_path=<a .ckpt file>, or ckpt_path=none to train the run from the start)" \
        in log and "ckpt=last" not in log
    assert f"Restoring states from the checkpoint path at {best}" in log
    assert _epoch(best) == 0 and _epoch(last) == 2  # rewritten: trained on to max_epochs
    for p in ckpts.glob("*.ckpt"):
        p.unlink()
    hydra = sorted(p.name for p in (run / ".hydra").iterdir())
    out = seg_train_here(tmp_path, f"hydra.run.dir={run}", *TINY, "trainer.max_epochs=3")
    assert out.returncode == 2
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith(f"seg-train: error: hydra.run.dir='{run}' holds a run")
    assert "no checkpoint to resume from" in line and "ckpt_path=none" in line
    assert sorted(p.name for p in (run / ".hydra").iterdir()) == hydra  # no resume_k added
    assert not list(ckpts.glob("*.ckpt"))  # nothing trained from scratch


def test_a_second_seg_train_into_the_same_folder_is_refused(tmp_path):
    run = tmp_path / "run"
    first = warm.popen(_cmd(run, "trainer.max_epochs=500"), env=_env(tmp_path),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (run / "checkpoints" / "last.ckpt").exists():  # the first one is training
        assert first.poll() is None and time.time() < deadline, first.stderr.read()[-2000:]
        time.sleep(0.05)
    second = seg_train_here(tmp_path, f"hydra.run.dir={run}", *TINY, "trainer.max_epochs=500")
    assert second.returncode == 2
    assert "is in use by another seg-train" in second.stderr.strip().splitlines()[-1]
    assert first.poll() is None  # still training: the refusal came while it held the lock
    first.send_signal(signal.SIGTERM)  # it saves last.ckpt and stops
    _, err = first.communicate(timeout=300)
    assert first.returncode == 143, err[-2000:]
    assert sorted(p.name for p in (run / "checkpoints").glob("last*.ckpt")) == ["last.ckpt"]
    assert len(list((run / "csv").rglob("metrics.csv"))) == 1
    assert not (run / ".seg_train.lock").exists()


def test_a_moved_run_folder_resumes(tmp_path):
    run_train(tmp_path, "run", *TINY)
    moved = tmp_path / "elsewhere" / "run"
    moved.parent.mkdir()
    shutil.move(tmp_path / "run", moved)
    steps = _step(moved / "checkpoints" / "last.ckpt")
    out = _train(tmp_path, moved, "trainer.max_epochs=2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"Restoring states from the checkpoint path at {moved}" in out.stdout + out.stderr
    assert f"the run was saved in {tmp_path / 'run'} and is now in {moved}" in (
        moved / "train.log").read_text()  # logged once the resume is accepted
    assert _step(moved / "checkpoints" / "last.ckpt") > steps  # trained on, in its new place
    assert not (tmp_path / "run").exists()  # nothing written where it was


def test_a_zero_std_is_named_with_its_band():
    values = {"root": "x", "bands": 4, "num_classes": 3, "class_names": None,
              "ignore_index": 255, "nodata": None, "scale": 1.0, "mean": [0.5] * 4,
              "std": [0.25, 0.25, 0.0, 0.25], "class_weights": None, "num_workers": 0,
              "synthetic": {}}
    with pytest.raises(ConfigError, match=r"data.std has 0.0 for band 2: a standard deviation"):
        data_config(values)


def _synth(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return warm.run([sys.executable, "-m", "seg_at_scale.cli.synth", *args],
                    capture_output=True, text=True, timeout=timeout,
                    env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})


def test_a_killed_dataset_synthesis_is_completed_by_the_same_command(tmp_path):
    """Before: the rerun demanded data.synthetic.overwrite=true over the killed run's files."""
    root = tmp_path / "ds"
    args = ["--out", str(root), "--height", "600", "--width", "600", "--train", "4", "--val",
            "1", "--test", "1"]
    proc = warm.popen([sys.executable, "-m", "seg_at_scale.cli.synth", *args],
                      env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while not list(root.glob("train/scene_0_mask.tif")):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert not (root / "manifest.json").exists()
    out = _synth(*args)
    assert out.returncode == 0, out.stderr
    assert (root / "manifest.json").exists() and not (root / ".building.json").exists()
    assert len(list(root.glob("*/*_image.tif"))) == 6 and not list(root.rglob(".*.tmp"))
    again = _synth(*args, "--seed", "0")
    assert again.returncode == 0 and "a reused dataset is not rewritten" in again.stdout


def test_seg_synth_refusals_are_one_line(tmp_path):
    from seg_at_scale.cli.synth import main

    def synth(*args: str) -> subprocess.CompletedProcess:  # the console script, in process
        return run_here(lambda: main(list(args)), ["seg-synth", *args])

    same = synth("--single", str(tmp_path / "a.tif"), str(tmp_path / "./a.tif"),
                 "--height", "40", "--width", "40")
    assert same.returncode == 2 and "the image and the mask are the same file" in same.stderr
    bad = synth("--single", str(tmp_path / "a.tif"), str(tmp_path / "b.tif"),
                "--compression", "foo")
    assert bad.returncode == 2 and "invalid choice: 'foo'" in bad.stderr
    ok = synth("--single", str(tmp_path / "a.tif"), str(tmp_path / "b.tif"), "--height", "40",
               "--width", "40")
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "a.tif").is_file() and (tmp_path / "b.tif").is_file()
    again = synth("--single", str(tmp_path / "a.tif"), str(tmp_path / "b.tif"), "--height",
                  "40", "--width", "40")
    assert again.returncode == 2 and "pass --overwrite" in again.stderr
    assert "overwrite=true" not in again.stderr
    assert "Traceback" not in same.stderr + again.stderr


NO_MODEL = [o for o in TINY if not o.startswith("model=")]


@pytest.mark.parametrize("model,fix", [
    ("unet_tiny", "set model.in_channels=4 (or leave it out: it follows data.bands); or set "
                  "data.bands to the images' bands"),
    ("smp", "to start from 3-band pretrained weights keep model.in_channels=4 and map the "
            "bands onto their channels with model.band_map (e.g. "
            "model.band_map=[0,1,2,null])"),
])
def test_a_model_for_other_bands_than_the_data_is_refused_before_any_work(tmp_path, model,
                                                                          fix):
    """Before: model.in_channels=3 on 4-band data passed the preflight and died in the
    first step ("expected input[8, 4, 256, 256] to have 3 channels")."""
    run = tmp_path / "run"
    out = seg_train_here(tmp_path, f"hydra.run.dir={run}", *NO_MODEL, f"model={model}",
                         "model.in_channels=3")
    assert out.returncode == 2, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("seg-train: error: model.in_channels=3 but data.bands=4: the "
                           "network would read 4-band tiles with a first layer for 3; ")
    assert fix in line
    assert not (tmp_path / "data").exists()  # no scene written, no model built


@pytest.mark.parametrize("groups,message", [
    (["model=uresnet_tiny"],
     "model=uresnet_tiny labels each detector plane (model.planes) apart, which "
     "task=segmentation does not score; use task=cosmic with data of one label band per "
     "plane (data=cosmic, or data.mask_bands=<planes>)"),
    (["model=unet_tiny", "task=cosmic", "data=cosmic"],
     "task=cosmic scores detector planes apart, which model=unet_tiny does not label; use "
     "model=uresnet_* (or another task)"),
    (["model=uresnet_tiny", "task=cosmic", "data=cosmic", "data.mask_bands=1"],
     "model=uresnet_tiny labels 3 planes (model.planes) but the data has 1 label band(s) per "
     "scene (data.mask_bands); give one label band per plane (data.mask_bands=3, "
     "data=cosmic)"),
    # before: "add a test/ split", which trained the whole run and then failed to write
    (["model=uresnet_tiny", "task=cosmic", "data=cosmic", "predict_after_fit=true"],
     "model=uresnet_tiny labels 3 detector planes apart, and the prediction after training "
     "writes one label per pixel; pass predict_after_fit=false, and predict the planes in "
     "Python (docs/models.md, \"UResNet and the CosmicTagger data\")"),
])
def test_a_network_of_planes_and_its_task_are_refused_apart_before_any_work(tmp_path, groups,
                                                                            message):
    """Before: ``model=uresnet_tiny`` on the default data trained its steps, then failed in
    the first validation ("Detected more unique values in `preds` than expected"), leaving
    a run folder without a checkpoint; a U-Net under ``task=cosmic`` had its logits cut into
    planes."""
    run = tmp_path / "run"
    tiny = [o for o in NO_MODEL if not o.startswith("data.synthetic.splits")]
    out = seg_train_here(tmp_path, f"hydra.run.dir={run}", *tiny, *groups)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == f"seg-train: error: {message}"
    assert not (tmp_path / "data").exists() and not run.exists()


@pytest.mark.parametrize("classes", [3, 7])
def test_a_model_for_other_classes_than_the_data_is_refused_before_any_work(tmp_path,
                                                                         classes):
    """Before: model.num_classes=3 on 5-class data failed in the first step ("Target 3 is
    out of bounds"), 7 after the first epoch in the metrics, each leaving a run folder."""
    run = tmp_path / "run"
    out = seg_train_here(tmp_path, f"hydra.run.dir={run}", *TINY,
                         f"model.num_classes={classes}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"seg-train: error: model.num_classes={classes} but data.num_classes=5: the network "
        f"would give {classes} logits per pixel for labels of 5 classes; set "
        "model.num_classes=5 (or leave it out: it follows data.num_classes), or "
        "data.num_classes to the masks' classes")
    assert not (tmp_path / "data").exists() and not run.exists()


def test_a_hub_name_offline_is_refused_without_waiting_on_the_resolver(tmp_path,
                                                                      monkeypatch):
    """Before: the offline decision waited on the hub's name lookup (unbounded: the
    connection's timeout does not cover it), after the scenes were written and while the
    model was built; a name server that never answers held the refusal for minutes. Now it
    is made once, abandoning the lookup after 2 s, before anything is built."""
    from seg_at_scale.cli import training as train  # what the entry point runs once its checks pass
    from seg_at_scale.models import weights

    asked, answered, release = [], threading.Event(), threading.Event()

    def never_answers(host, *args, **kwargs):  # a name server that does not reply
        asked.append(host)
        release.wait(20)
        answered.set()
        raise socket.gaierror("timed out")

    def never(*args, **kwargs):
        pytest.fail("built before the offline refusal")

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(weights, "_HUB_PROBE", {}, raising=False)  # not decided yet
    monkeypatch.setattr(socket, "getaddrinfo", never_answers)
    monkeypatch.setattr(train, "synthesize", never)
    monkeypatch.setattr(train, "build_model", never)
    try:
        out = seg_train_here(tmp_path, f"hydra.run.dir={tmp_path / 'run'}", *NO_MODEL,
                             "model=smp", "model.encoder_weights=imagenet",
                             env={"HF_HOME": str(tmp_path / "hf")})  # nothing cached
        waited = answered.is_set()
    finally:
        release.set()
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "seg-train: error: model.encoder_weights='imagenet' is a hub name, but this machine "
        "is offline (HF_HUB_OFFLINE=1, or huggingface.co did not answer within 2 s) and the "
        "weights are not in the local Hugging Face cache; download the weights where there "
        "is internet (e.g. `hf download smp-hub/resnet34.imagenet model.safetensors "
        "config.json`) and pass the file: model.encoder_weights=/path/to/model.safetensors")
    assert asked == ["huggingface.co"]  # asked once
    assert not waited  # refused while the lookup still hung: abandoned at the deadline


def test_hf_hub_offline_refuses_before_the_scenes_and_the_model(tmp_path, monkeypatch):
    from seg_at_scale.cli import training as train  # what the entry point runs once its checks pass

    def never(*args, **kwargs):
        pytest.fail("built before the offline refusal")

    monkeypatch.setattr(train, "synthesize", never)
    monkeypatch.setattr(train, "build_model", never)
    out = seg_train_here(tmp_path, f"hydra.run.dir={tmp_path / 'run'}", *NO_MODEL,
                         "model=unet_test_resnet", "model.encoder_weights=imagenet",
                         env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "model.encoder_weights='imagenet' is a hub name, but this machine is offline" in (
        out.stderr.strip().splitlines()[-1])


def test_keys_a_group_leaves_to_the_user_are_named_in_one_line(tmp_path, scene_files):
    """Before: ``seg-train data=tiff data.root=mine`` without data.bands ended in omegaconf's
    traceback ("Missing mandatory value: data.bands"), and so did ``pipeline=manual``
    without a balance. Now one line lists every unset key and what to give it: the training
    images' band count when data.root names readable scenes."""
    root = tmp_path / "mine"
    for split in ("train", "val"):
        scene_files(root / split, shape=(3, 61, 53))
    cases = [
        ([f"data.root={root}"], "data.bands and data.num_classes have no value (data=tiff "
         "leaves them to you); add data.bands=3 data.num_classes=<the classes in the masks: "
         "labels 0..K-1>"),
        ([], "data.root, data.bands and data.num_classes have no value (data=tiff leaves them "
         "to you); add data.root=<the folder of your train/ val/ test/ splits> "
         "data.bands=<the images' band count> data.num_classes="),
        ([f"data.root={root}", "data.bands=3", "pipeline=manual"], "data.num_classes and "
         "pipeline.balance have no value (data=tiff, pipeline=manual leaves them to you); "
         "add data.num_classes=<the classes in the masks: labels 0..K-1> "
         "pipeline.balance=<the layers of each stage, e.g. [14,24]>")]
    run = tmp_path / "run"
    for extra, said in cases:
        out = seg_train_here(tmp_path, "data=tiff", *extra, "model=unet_tiny",
                             f"hydra.run.dir={run}")
        assert out.returncode == 2, out.stderr[-2000:]
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"seg-train: error: {said}"), lines
    assert not run.exists()  # the refused runs left no folder


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine whose torch sees no GPU")
def test_a_gpu_trainer_on_a_machine_without_one_is_refused_before_any_work(tmp_path):
    """Before: trainer=gpu ran the preflight, wrote the run folder and ended in Hydra's
    four-line wrapping of Lightning's "No supported gpu backend found!" (exit 1)."""
    run = tmp_path / "run"
    out = seg_train_here(tmp_path, f"hydra.run.dir={run}", "trainer=gpu",
                         *(o for o in TINY if not o.startswith("trainer=")))
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(
        "seg-train: error: trainer.accelerator=gpu but torch sees no GPU (torch ")
    assert "train on the CPU with trainer=default" in out.stderr
    assert not run.exists()


def test_more_gpus_than_the_machine_has_are_refused_naming_the_count(monkeypatch):
    from seg_at_scale.cli.training import check_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_devices("gpu", 2)
    check_devices("cuda", [0, 1])
    check_devices("cpu", 8)
    for devices in (4, [1, 2]):
        with pytest.raises(ConfigError, match=re.escape(
                f"trainer.devices={devices} but this machine has 2 GPU(s) (cuda:0..1); use "
                "trainer.devices=2 or fewer")):
            check_devices("gpu", devices)


def test_a_new_run_in_a_folder_of_the_users_files_is_refused_and_they_stay(tmp_path):
    """Before: ``hydra.run.dir`` at a folder of the user's replaced their ``summary.json``,
    ``trial.json`` and ``predictions/*.tif`` with the run's, exit 0."""
    folder = tmp_path / "mine"
    (folder / "predictions").mkdir(parents=True)
    (folder / "summary.json").write_text("my notes")
    (folder / "predictions" / "sc0_pred.tif").write_bytes(b"mine")
    out = seg_train_here(tmp_path, f"hydra.run.dir={folder}", *TINY)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"seg-train: error: hydra.run.dir='{folder}' holds files that are not a seg_at_scale "
        "run (predictions, summary.json), which a new run could replace; choose a new or "
        "empty folder (leave out hydra.run.dir for a new one)")
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == [
        "predictions", "predictions/sc0_pred.tif", "summary.json"]
    assert (folder / "summary.json").read_text() == "my notes"


def test_several_processes_without_sample_parallelism_are_refused_before_any_work(tmp_path):
    """Before: ``trainer.devices=2`` on the default trainer ran Lightning's DDP, whose sampler
    split each rank's share of the tiles again: 1/2 of the data trained, part of the
    validation tiles scored, exit 0."""
    run = tmp_path / "run"
    out = seg_train_here(tmp_path, f"hydra.run.dir={run}", *TINY, "trainer.devices=2")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "seg-train: error: trainer.devices=2 (trainer.num_nodes=1) runs 2 processes, which "
        "train by sample parallelism: add trainer=ddp (each process takes its share of every "
        "image's tiles and the gradients are summed per image)")
    assert not run.exists()


def test_what_lightning_refuses_in_the_trainer_group_is_one_line_and_no_run(tmp_path):
    """An unknown strategy name came as Hydra's wrapping of Lightning's ValueError; then the
    refusal came after the run's config was saved, and the corrected command in the same
    folder was refused as "a run with another config"."""
    run = tmp_path / "run"
    out = seg_train_here(tmp_path, f"hydra.run.dir={run}", *TINY, "+trainer.strategy=ddpx")
    assert out.returncode == 2, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("seg-train: error: the trainer group: Lightning says: You selected "
                           "an invalid strategy name: `strategy='ddpx'`."), line
    assert not (run / "run_config.yaml").exists()
    assert not (run / ".hydra").exists()
    out = seg_train_here(tmp_path, f"hydra.run.dir={run}", *TINY)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "another config" not in out.stderr
    assert OmegaConf.load(run / "run_config.yaml").trainer.get("strategy") != "ddpx"
    assert list((run / "checkpoints").glob("*.ckpt"))


@pytest.mark.parametrize(("override", "expected"), [
    ("task.optimizer.lr=-1", "task.optimizer.lr=-1 must be above 0; give e.g. "
     "task.optimizer.lr=0.001"),
    ("task.optimizer.lr=0", "task.optimizer.lr=0 must be above 0"),
    ("task.optimizer.lr=abc", "task.optimizer.lr='abc' is not a number; give e.g. "
     "task.optimizer.lr=0.001"),
    ("task.optimizer.weight_decay=-0.1", "task.optimizer.weight_decay=-0.1 must be 0 or more"),
    ("seed=abc", "seed='abc' is not a whole number; give e.g. seed=0"),
    ("seed=1.5", "seed=1.5 is not a whole number"),
    ("trainer.max_epochs=0", "trainer.max_epochs=0 trains nothing; give e.g. "
     "trainer.max_epochs=12"),
    ("trainer.max_epochs=-1", "trainer.max_epochs=-1 never ends: give trainer.max_steps or "
     "trainer.max_time with it"),
    ("trainer.max_epochs=-3", "trainer.max_epochs=-3 is not an epoch count"),
])
def test_a_learning_rate_or_seed_torch_would_refuse_is_one_line_before_work(tmp_path, override,
                                                                           expected):
    """Before: tracebacks (torch's "Invalid learning rate: -1", int()'s ValueError) after
    Lightning had started, and the run folder they left refused the corrected rerun."""
    run = tmp_path / "run"
    out = seg_train_here(tmp_path, f"hydra.run.dir={run}", *TINY, override)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(f"seg-train: error: {expected}")
    assert not (run / "run_config.yaml").exists() and not (tmp_path / "data").exists()


def test_a_missing_test_split_names_predict_after_fit(tmp_path, scene_files):
    """Before: "data.root (test split): folder '…/test' does not exist", without the
    option that trains without one."""
    root = tmp_path / "mine"
    for split in ("train", "val"):
        scene_files(root / split, shape=(3, 61, 53))
    args = ("data=tiff", f"data.root={root}", "data.bands=3", "data.num_classes=5",
            "model=unet_tiny", "trainer=fast", "logger=csv", "tiling.tile_size=56")
    out = seg_train_here(tmp_path, *args, f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"seg-train: error: data.root: '{root / 'test'}' does not exist: the held-out scenes "
        "seg-train predicts and scores after training; add a test/ split, or pass "
        "predict_after_fit=false to train without one")
    assert not (tmp_path / "run").exists()
    out = seg_train_here(tmp_path, *args, "predict_after_fit=false",
                         f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize("trainer", [{"max_epochs": -1, "max_steps": 10},
                                     {"max_epochs": -1, "max_time": "00:01:00:00"},
                                     {"max_epochs": 1}, {"max_epochs": 12, "max_steps": -1}])
def test_epoch_limits_lightning_ends_on_are_accepted(trainer):
    from seg_at_scale.cli.train import check_epochs

    assert check_epochs(OmegaConf.create({"trainer": trainer})) is None


def test_logger_none_trains_without_a_logger(tmp_path):
    """Before: ``logger=none`` (a listed option) failed at the fit's start with Lightning's
    "Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger", leaving
    a run folder without a checkpoint that the next command was refused into."""
    import json

    run = tmp_path / "run"
    tiny = [o for o in TINY if not o.startswith("logger=")]
    out = seg_train_here(tmp_path, *tiny, "logger=none", f"hydra.run.dir={run}")
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 <= summary["val/miou"] <= 1.0
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert not (run / "csv").exists() and not (run / "wandb").exists()


def test_the_default_wandb_logger_writes_its_offline_run_without_wandbs_warning(tmp_path):
    """Before: every run with the default logger (``make demo``) printed ``wandb: WARNING
    The anonymous setting has no effect ...``: Lightning passes wandb a setting it no longer
    reads (run_train refuses that line among the noise)."""
    tiny = [o for o in TINY if not o.startswith("logger=")]
    summary = run_train(tmp_path, "run", *tiny, "logger=wandb")
    assert "wandb: " in summary["log"]  # wandb's own lines are there, its warning is not
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    record = b"".join(p.read_bytes() for p in runs[0].glob("run-*.wandb"))
    assert b"computed" in record and b"efficiency" in record  # the run's hyperparameters
    # resumed, it goes on in the same wandb run (before: a new run at every resume): offline,
    # a second folder of the same id, which `wandb sync` uploads into that run
    again = run_train(tmp_path, "run", *tiny, "logger=wandb", "trainer.max_epochs=2")
    assert "resuming the run" in again["log"]
    starts = sorted(p.name for p in (tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(starts) == 2 and starts[0].split("-")[-1] == starts[1].split("-")[-1], starts


def test_a_diverged_run_stops_at_its_nan_loss(tmp_path):
    """Before: ``task.optimizer.lr=1e12`` trained to the end (exit 0, val/miou 0.06), saved
    NaN weights as its best checkpoint, and seg-predict labelled every pixel 0."""
    from seg_at_scale.models.trained import load_run

    run = tmp_path / "run"
    out = seg_train_here(tmp_path, *TINY, "trainer.max_epochs=3", "task.optimizer.lr=1e12",
                         "task.gradient_clip=0", f"hydra.run.dir={run}")
    assert out.returncode == 2, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"seg-train: error: the training diverged: the loss is NaN or infinite "
                        r"at epoch \d, step \d+ \(task\.optimizer\.lr=1000000000000\.0\); "
                        r"train a new run with a lower task\.optimizer\.lr \(or "
                        r"task\.gradient_clip\); the checkpoints of the epochs before are kept",
                        line), line
    assert not (run / "summary.json").exists()
    for ckpt in (run / "checkpoints").glob("*.ckpt"):  # what is kept loads: finite weights
        load_run(run, str(ckpt))


def test_a_resumed_or_rerun_runs_record_keeps_the_epochs_before(tmp_path):
    """Before: a finished run rerun (a sweep's command again) rewrote trial.json with
    ``best: null`` and no history, and a resumed run's record held only the epochs after the
    resume: the sweep's objective was lost, or wrong when the best epoch came before."""
    import json

    run = tmp_path / "run"
    args = [o for o in TINY if not o.startswith("predict_after_fit")]
    args += ["predict_after_fit=false", f"hydra.run.dir={run}"]
    assert seg_train_here(tmp_path, *args, "trainer.max_epochs=2").returncode == 0
    first = json.loads((run / "trial.json").read_text())
    assert [e for e, _ in first["history"]] == [0, 1] and first["best"] is not None
    again = seg_train_here(tmp_path, *args, "trainer.max_epochs=2")  # nothing left to fit
    assert again.returncode == 0, again.stderr[-2000:]
    rerun = json.loads((run / "trial.json").read_text())
    assert (rerun["history"], rerun["best"], rerun["best_epoch"]) == (
        first["history"], first["best"], first["best_epoch"])
    more = seg_train_here(tmp_path, *args, "trainer.max_epochs=3")  # resumed for one more
    assert more.returncode == 0, more.stderr[-2000:]
    third = json.loads((run / "trial.json").read_text())
    assert third["history"][:2] == first["history"] and third["history"][2][0] == 2
    assert third["best"] == max(v for _, v in third["history"])
    assert third["fit_s"] > first["fit_s"]


def test_a_copied_run_resumes_from_last_ckpt_whatever_the_copy_did_to_mtimes(tmp_path):
    """Before: the newest file by mtime won, so after ``cp -r`` (or rsync without -t) a best
    checkpoint of an earlier epoch was resumed from and its later epochs trained again."""
    import os

    from seg_at_scale.tasks.interrupt import checkpoints_of, newest_checkpoint

    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    for name, step in (("last.ckpt", 600), ("epoch001-miou0.5064.ckpt", 400)):
        torch.save({"state_dict": {}, "global_step": step}, ckpts / name)
    os.utime(ckpts / "last.ckpt", ns=(1_000_000_000, 1_000_000_000))  # the copy: older
    assert [p.name for p in checkpoints_of(tmp_path / "run")] == [
        "last.ckpt", "epoch001-miou0.5064.ckpt"]
    assert newest_checkpoint(tmp_path / "run") == ckpts / "last.ckpt"


@pytest.mark.parametrize("override, said", [
    ("data.nodata=abc", "data.nodata='abc': give the images' no-data value, nan, or null"),
    ("data.class_weight_power=abc", "data.class_weight_power='abc': give a number >= 0"),
    ("seed=-1", "seed=-1: give a whole number from 0 to 4294967295"),
    ("task.gradient_clip=abc", "task.gradient_clip='abc': give the largest gradient norm"),
    ("tiling.augment.brightness=abc", "tiling.augment.brightness='abc': give a limit >= 0"),
    ("callbacks.model_checkpoint.monitor=val/mIoU", "callbacks.model_checkpoint.monitor="
     "'val/mIoU' is not a metric the run logs; did you mean 'val/miou'?"),
    ("data.ignore_index=1", "data.ignore_index=1 is one of the classes 0..4 "
     "(data.num_classes=5): the label that carries no loss lies outside them; give 255"),
    ("finetune.encoder_lr_scale=0", "finetune.encoder_lr_scale=0: give a factor > 0"),
    ("finetune.freeze_bn=bogus", "finetune.freeze_bn='bogus': use one of ['auto', 'all', "
     "'encoder', 'none']"),
    ("model_family=uresnet", "model_family=uresnet: a model family is chosen by its model "
     "preset, model=<family>_<size> (model=uresnet_cosmic, "),
])
def test_bad_values_are_one_line_naming_the_key_before_training(tmp_path, override, said):
    """Before: each was a traceback and exit 1 (the monitor's after the first epoch); an
    ignore_index among the classes trained, and scored NaN everywhere."""
    out = seg_train_here(tmp_path, f"hydra.run.dir={tmp_path / 'run'}", *TINY, override)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(f"seg-train: error: {said}")
    assert not list((tmp_path / "run").rglob("*.ckpt"))


@pytest.mark.parametrize("tiling", [["tiling=grid", "tiling.batch_size=4"],
                                    ["experiment=finetune", "tiling.core_size=32"]])
def test_random_tile_keys_in_grid_mode_are_refused_naming_the_mode(tmp_path, tiling):
    """Before: accepted, written into run_config.yaml and ignored (experiment=finetune
    chooses tiling=grid, so its users' tiling.* overrides did nothing)."""
    out = seg_train_here(tmp_path, f"hydra.run.dir={tmp_path / 'run'}", *TINY, *tiling)
    assert out.returncode == 2, out.stderr[-2000:]
    key = tiling[1].split("=")[0]
    assert out.stderr.strip().splitlines()[-1].startswith(
        f"seg-train: error: {key}={tiling[1].split('=')[1]} is for tiling=random (random "
        "tiles), and this run tiles by tiling=grid (which experiment=finetune also chooses)")


def test_a_batch_limit_below_one_images_grid_tiles_is_refused_before_training(tmp_path):
    """Before: ``trainer=fast`` (2 batches) with 4 grid tiles per image ended each epoch
    before an image's last tile, so no optimiser step was taken: exit 0, and last.ckpt held
    the start weights."""
    run = tmp_path / "run"
    out = seg_train_here(tmp_path, f"hydra.run.dir={run}", *TINY, "tiling=grid",
                         "tiling.q=2", "tiling.tile_size=null")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "seg-train: error: trainer.limit_train_batches=2 ends each epoch before an image's 4 "
        "grid tiles, and grid training steps once per whole image: no step would be taken; "
        "give trainer.limit_train_batches >= 4 (a multiple of it: whole images), or train on "
        "random tiles (tiling=random)")
    assert not run.exists()  # refused before the run began


def test_batch_norms_that_train_under_grid_tiling_are_warned_about(caplog):
    """``tiling=grid`` promises the whole image's gradient, which a training BatchNorm (one
    tile's statistics) breaks: said, unless they are frozen."""
    from omegaconf import OmegaConf

    from seg_at_scale.cli.training import warn_training_norms
    from seg_at_scale.models import UNet

    grid = OmegaConf.create({"tiling": {"mode": "grid"}})
    for freeze, warned in (("none", True), ("all", False)):
        caplog.clear()
        net = UNet(3, 5, levels=2, base_width=4, norm="batch")
        with caplog.at_level("WARNING", logger="seg_at_scale.train"):
            warn_training_norms(net, grid, freeze)
        said = [r.getMessage() for r in caplog.records]
        assert bool(said) == warned, said
        if warned:
            norms = sum(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules())
            assert said[0].startswith(f"{norms} BatchNorm layers train (finetune.freeze_bn="
                                      "none): each grid tile is normalised with its own "
                                      "statistics")
