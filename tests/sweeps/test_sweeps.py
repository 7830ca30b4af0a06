"""Sweeps: the optuna sweeper (search space, stored study, resume after SIGKILL, pruning),
parallel trials with their thread share, the sweep report and the two notebooks."""

from __future__ import annotations

import csv
import doctest
import importlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import optuna
import pytest
import torch
from helpers import warm
from omegaconf import OmegaConf

from seg_at_scale.cli.resolvers import register_resolvers
from seg_at_scale.errors import ConfigError
from seg_at_scale.sweeps.pruning import PRUNED_AT, OptunaPruning
from seg_at_scale.sweeps.report import collect_trials
from seg_at_scale.sweeps.report import main as report_main
from seg_at_scale.sweeps.space import search_space
from seg_at_scale.sweeps.study import INTERRUPTED, open_storage, open_study, storage_url
from seg_at_scale.tasks.class_weights import scene_class_weights

REPO = Path(__file__).resolve().parents[2]
TINY = ["trainer=fast", "logger=csv", "model=unet_tiny", "data.synthetic.height=157",
        "data.synthetic.width=189", "data.synthetic.splits={train:2,val:1,test:1}",
        "tiling.tile_size=96", "predict.tile_size=96"]
# 3 trials of 2 short epochs; lr spread wide enough that the objectives differ
OPTUNA = ["hparams_search=optuna", *TINY, "tiling.tile_size=256",
          "trainer.max_epochs=2", "trainer.limit_train_batches=3",
          "tiling.core_size=choice(32,48)", "tiling.batch_size=choice(2,4)",
          "task.optimizer.lr=tag(log,interval(0.003,0.1))", "hydra.sweeper.n_trials=3"]
optuna.logging.set_verbosity(optuna.logging.WARNING)


def _env(tmp: Path) -> dict[str, str]:
    # the checkout under test first on the path (the venv may hold another editable copy)
    return {"SEG_DATA_DIR": str(tmp / "data"), "PATH": "/usr/bin:/bin", "WANDB_MODE": "offline",
            "PYTHONPATH": str(REPO)}


def _train_cmd(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "seg_at_scale.cli.train", *overrides]


@pytest.mark.parametrize("module", ["sweeps.space", "sweeps.study", "sweeps.launcher",
                                    "tasks.class_weights"])
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(f"seg_at_scale.{module}"))
    assert result.attempted > 0 and result.failed == 0


def test_search_space_reads_hydra_sweep_syntax_and_conditions():
    params = {"lr": "tag(log, interval(1e-4, 1e-2))", "size": "choice(tiny,small,medium)",
              "depth": "range(2, 9, 3)", "memory": "choice(none,checkpoint)"}
    space = search_space(params, ["trainer=fast", "lr=0.5"], {"memory": {"size": ["medium"]}})
    assert [p.name for p in space.params] == ["size", "depth", "memory"]  # lr fixed on the CLI
    assert space.fixed == ("trainer=fast", "lr=0.5")
    depth = space.params[1]
    assert (depth.kind, depth.low, depth.high, depth.step) == ("int", 2, 8, 3)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(12):
        values = space.suggest(study.ask())
        assert ("memory" in values) == (values["size"] == "medium")
    # a condition on a key fixed on the command line is decided once
    assert "memory" in [p.name for p in search_space(params, ["size=medium"],
                                                     {"memory": {"size": ["medium"]}}).params]
    assert "memory" not in [p.name for p in search_space(params, ["size=tiny"],
                                                         {"memory": {"size": ["medium"]}}).params]
    with pytest.raises(ConfigError, match=r"params.lr=interval\(0.1, 0.01\): interval needs low"):
        search_space({"lr": "interval(0.1, 0.01)"})
    with pytest.raises(ConfigError, match="conditions.memory: 'size' must be a searched key"):
        search_space({"memory": "choice(a,b)"}, conditions={"memory": {"size": ["x"]}})


def test_reopened_study_counts_finished_and_requeues_interrupted(tmp_path):
    url = storage_url(None, tmp_path)
    study, resume = open_study(url, "s", "maximize")
    assert resume.finished == 0
    for x in (0.1, 0.2):
        t = study.ask()
        t.suggest_float("x", 0, 1)
        study.tell(t, x)
    stale = study.ask()  # a sweep killed while this trial trained
    stale_x = stale.suggest_float("x", 0, 1)
    study, resume = open_study(url, "s", "maximize")
    assert (resume.finished, resume.requeued) == (2, (2,))
    old = study.trials[2]
    assert old.state.name == "FAIL" and old.user_attrs[INTERRUPTED]
    rerun = study.ask()
    assert rerun.suggest_float("x", 0, 1) == stale_x  # the interrupted parameters, again
    with pytest.raises(ConfigError, match="was created to maximize"):
        open_study(url, "s", "minimize")


def test_pruning_callback_reports_each_epoch_and_stops_the_trial(tmp_path):
    url = storage_url(None, tmp_path)
    study, _ = open_study(url, "s", "maximize")
    trial = study.ask()
    cb = OptunaPruning("s", trial.number, str(tmp_path), monitor="val/miou",
                       pruner=optuna.pruners.ThresholdPruner(lower=0.3))
    trainer = SimpleNamespace(is_global_zero=True, sanity_checking=False, should_stop=False,
                              current_epoch=0, callback_metrics={"val/miou": torch.tensor(0.5)},
                              strategy=SimpleNamespace(broadcast=lambda x, src=0: x))
    cb.on_fit_start(trainer, None)
    cb.on_validation_end(trainer, None)
    assert not trainer.should_stop
    trainer.current_epoch, trainer.callback_metrics = 1, {"val/miou": torch.tensor(0.2)}
    cb.on_validation_end(trainer, None)
    assert trainer.should_stop
    stored = study.trials[trial.number]
    assert stored.intermediate_values == pytest.approx({0: 0.5, 1: 0.2})
    assert stored.user_attrs[PRUNED_AT] == 1


def test_class_weight_power_reads_the_training_masks(tmp_path, scene_files):
    _, mask = scene_files(tmp_path / "train", "a", shape=(4, 40, 30), classes=3)
    from seg_at_scale.io import read_raster

    counts = np.bincount(read_raster(mask)[0].ravel(), minlength=3).astype(float)
    expect = counts.sum() / (3 * counts)
    assert scene_class_weights(tmp_path, 3, 255, 1.0) == pytest.approx(expect, abs=1e-4)
    assert scene_class_weights(tmp_path, 3, 255, 0.0) is None
    register_resolvers()
    cfg = OmegaConf.create({"p": 0.5, "w": "${seg.class_weights:" + str(tmp_path) + ",3,255,${p}}"})
    assert cfg.w == pytest.approx(np.sqrt(expect), abs=1e-4)
    with pytest.raises(ConfigError, match="data.class_weight_power=3.0"):
        scene_class_weights(tmp_path, 3, 255, 3.0)


@pytest.fixture(scope="module")
def killed_sweep(tmp_path_factory):
    """A 3-trial optuna sweep SIGKILLed as trial 1 starts, then the same command again."""
    tmp = tmp_path_factory.mktemp("sweep")
    folder = tmp / "sweep"
    cmd = _train_cmd(*OPTUNA, f"hydra.sweep.dir={folder}", "hydra.sweeper.study_name=s")
    first = warm.popen(cmd, env=_env(tmp), cwd=REPO, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    # Hydra writes a job's .hydra/ before it trains: trial 0 is told, trial 1 has started
    while not (folder / "1" / ".hydra" / "overrides.yaml").exists():
        assert first.poll() is None and time.time() < deadline, "trial 1 never started"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    done_before = (folder / "0" / "summary.json").stat().st_mtime
    again = warm.run(cmd, env=_env(tmp), cwd=REPO, capture_output=True, text=True,
                     timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    return SimpleNamespace(tmp=tmp, folder=folder, log=again.stdout + again.stderr,
                           done_before=done_before)


def test_killed_sweep_reruns_only_unfinished_trials(killed_sweep):
    folder, log = killed_sweep.folder, killed_sweep.log
    trials = optuna.load_study(study_name="s", storage=f"sqlite:///{folder / 'optuna.db'}").trials
    states = [t.state.name for t in trials]
    assert states == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    assert trials[1].user_attrs[INTERRUPTED] and trials[2].params == trials[1].params
    assert "1 finished trials stored, 2 to run" in log
    launched = [line.split("#")[1].split(":")[0].strip() for line in log.splitlines()
                if "\t#" in line]
    assert launched == ["2", "3"]  # trial 0 was not run again
    assert (folder / "0" / "summary.json").stat().st_mtime == killed_sweep.done_before


def test_every_trials_checkpoints_are_plain_data(killed_sweep):
    from helpers.cli import assert_plain_checkpoints

    assert assert_plain_checkpoints(killed_sweep.folder) >= 3  # trials 0, 2, 3 at least


def test_sweep_report_rows_hold_each_runs_best_val_miou(killed_sweep):
    folder = killed_sweep.folder
    with open(folder / "sweep_report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["status"]) for r in rows] == [
        ("0", "complete"), ("1", "interrupted"), ("2", "complete"), ("3", "complete")]
    for r in rows:
        if r["status"] != "complete":
            continue
        own = _miou_history(folder / r["job"])
        assert len(own) == 2 and float(r["objective"]) == pytest.approx(max(own), rel=1e-6)
    assert {"task.optimizer.lr", "tiling.core_size", "tiling.batch_size"} <= set(rows[0])
    assert (folder / "sweep_report.png").stat().st_size > 10_000
    report = collect_trials(folder)
    command = (folder / "best_command.txt").read_text()
    assert command.startswith("seg-train ") and "hparams_search" not in command
    assert f"task.optimizer.lr={report.best.value_of('task.optimizer.lr')}" in command
    assert report.best.objective == max(float(r["objective"]) for r in rows
                                         if r["status"] == "complete")


def _miou_history(run: Path) -> list[float]:
    with open(run / "csv" / "version_0" / "metrics.csv") as f:
        return [float(m["val/miou"]) for m in csv.DictReader(f) if m["val/miou"]]


@pytest.mark.slow  # make test-all; the property is also proven by faster tests
def test_parallel_trials_get_their_share_of_threads_and_report_to_the_study(tmp_path):
    folder = tmp_path / "sweep"
    out = warm.run(_train_cmd(*OPTUNA, "hydra.sweeper.n_trials=2", "predict_after_fit=false",
                                    "hydra/launcher=local_parallel", "hydra.launcher.n_jobs=2",
                                    "hydra.launcher.cores=2", f"hydra.sweep.dir={folder}",
                                    "hydra.sweeper.study_name=p"),
                   env=_env(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Launching 2 jobs, 2 at a time, 1 torch threads each (2 cores)" in out.stdout
    report = collect_trials(folder)
    assert [r.status for r in report.rows] == ["complete", "complete"]
    assert [r.record["threads"] for r in report.rows] == [1, 1]  # 2 cores / 2 trials
    trials = optuna.load_study(study_name="p", storage=f"sqlite:///{folder / 'optuna.db'}").trials
    for t in trials:  # the pruning callback in each child process reported every epoch
        assert list(t.intermediate_values.values()) == pytest.approx(
            _miou_history(folder / str(t.number)))


def test_grid_sweep_report_finds_the_varying_key_and_the_best_command(tmp_path, capsys):
    folder = tmp_path / "grid"
    for job, (q, best) in enumerate([(1, 0.31), (2, 0.42), (4, None)]):
        run = folder / f"{job}_tiling.q={q}"
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "overrides.yaml").write_text(
            f"- tiling=grid\n- tiling.q={q}\n- logger=csv\n")
        (run / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  job:\n    num: {job}\n")
        (run / ".hydra" / "config.yaml").write_text("{}\n")
        if best is not None:  # job 2 never finished
            (run / "trial.json").write_text(json.dumps({"monitor": "val/miou", "mode": "max",
                                                        "best": best, "threads": 2}))
            (run / "summary.json").write_text(json.dumps({"val/miou": best - 0.1}))
    out = warm.run([sys.executable, "-m", "seg_at_scale.sweeps.report", str(folder)],
                   env=_env(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    with open(folder / "sweep_report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["status"], r["tiling.q"], r["objective"]) for r in rows] == [
        ("0", "complete", "1", "0.31"), ("1", "complete", "2", "0.42"),
        ("2", "incomplete", "4", "")]
    assert "best: job 1, objective 0.4200" in out.stdout
    command = "seg-train tiling=grid tiling.q=2 logger=csv"
    assert command in out.stdout and (folder / "best_command.txt").read_text().strip() == command
    (folder / "multirun.yaml").write_text("{}\n")  # what Hydra writes in a sweep folder
    one_run = tmp_path / "runs" / "2026-11-30_10-00-00"
    (one_run / ".hydra").mkdir(parents=True)
    (one_run / ".hydra" / "overrides.yaml").write_text("[]\n")
    job = folder / "1_tiling.q=2"
    for given, said in [  # a path that is not a sweep folder names the one to give
            (tmp_path, "holds no Hydra job folders itself; the sweep folders below it: "
                       f"{folder}\n"),
            (tmp_path / "grd", "does not exist; give the sweep folder (hydra.sweep.dir)"),
            (job, f"is one job of a sweep; give the sweep folder that holds it: "
                  f"seg-sweep-report {folder}"),
            (one_run, "is the folder of one run, not of a sweep; give the sweep folder"),
            (one_run / ".hydra", "holds no Hydra job folders (*/.hydra/overrides.yaml)")]:
        with pytest.raises(SystemExit) as stop:
            report_main([str(given)])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and f"'{given}' " in err and said in err, err


def test_job_outcome_reads_the_runs_best_value(tmp_path):
    from hydra.core.utils import JobReturn, JobStatus

    from seg_at_scale.sweeps.optuna_sweep import job_outcome

    (tmp_path / "trial.json").write_text(json.dumps({"monitor": "val/miou", "best": 0.7}))
    hydra_cfg = OmegaConf.create({"hydra": {"runtime": {"output_dir": str(tmp_path)}}})
    ok = JobReturn(hydra_cfg=hydra_cfg, status=JobStatus.COMPLETED, _return_value=0.5)
    assert job_outcome(ok, "val/miou", None) == ("complete", 0.7)  # best, not the last 0.5
    assert job_outcome(ok, "val/miou", 3) == ("pruned", None)
    bad = JobReturn(hydra_cfg=hydra_cfg, status=JobStatus.FAILED, _return_value=RuntimeError())
    assert job_outcome(bad, "val/miou", None) == ("failed", None)
    with pytest.raises(ConfigError, match="objective='val/loss' but the runs record 'val/miou'"):
        job_outcome(ok, "val/loss", None)


def test_run_study_tells_each_outcome_and_stops_after_max_failures(tmp_path):
    from hydra.core.utils import JobReturn, JobStatus

    from seg_at_scale.sweeps.optuna_sweep import StudySettings, run_study

    firsts: list[int] = []

    def launch(batch, first):  # job n: even n completes with best = n / 10, odd n fails,
        firsts.append(first)  # job 2 is pruned (its callback marks the trial in the study)
        out = []
        for n, overrides in enumerate(batch, start=first):
            if n == 2:
                storage = open_storage(storage_url(None, tmp_path))
                storage.set_trial_user_attr(storage.get_trial_id_from_study_id_trial_number(
                    storage.get_study_id_from_name("s"), n), PRUNED_AT, 1)
            run = tmp_path / str(n)
            run.mkdir()
            (run / "trial.json").write_text(json.dumps({"monitor": "val/miou", "best": n / 10}))
            cfg = OmegaConf.create({"hydra": {"runtime": {"output_dir": str(run)}}})
            out.append(JobReturn(overrides=overrides, hydra_cfg=cfg, _return_value=ValueError(n),
                                 status=JobStatus.FAILED if n % 2 else JobStatus.COMPLETED))
        return out

    space = search_space({"x": "interval(0, 1)"})
    settings = StudySettings("s", None, "maximize", "val/miou", n_trials=4, n_jobs=2, seed=0,
                             max_failures=2)
    run_study(settings, space, tmp_path, launch)
    study = optuna.load_study(study_name="s", storage=storage_url(None, tmp_path))
    assert [(t.state.name, t.value) for t in study.trials] == [
        ("COMPLETE", 0.0), ("FAIL", None), ("PRUNED", None), ("FAIL", None)]
    assert firsts == [0, 2]  # job numbers = trial numbers
    more = StudySettings(**{**settings.__dict__, "n_trials": 6, "max_failures": 0})
    with pytest.raises(ValueError, match="5"):  # a failure past the limit re-raises its error
        run_study(more, space, tmp_path, launch)
    assert [t.state.name for t in study.trials][4:] == ["COMPLETE", "FAIL"]  # both told


def test_optuna_search_composes_every_choice_on_the_checkpoint_metric():
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate

    with initialize_config_dir(str(REPO / "seg_at_scale" / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[
            "hparams_search=optuna", "model=unet_medium", "memory=checkpoint",
            "tiling.core_size=192", "tiling.batch_size=16", "data.class_weight_power=0.5"],
            return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    sweeper = cfg.hydra.sweeper
    assert sweeper.objective == cfg.callbacks.model_checkpoint.monitor == "val/miou"
    assert cfg.callbacks.early_stopping.monitor == cfg.callbacks.trial_record.monitor == "val/miou"
    space = search_space(dict(sweeper.params), conditions=OmegaConf.to_container(
        sweeper.conditions))
    assert {p.name for p in space.params} >= {"task.optimizer.lr", "model", "memory"}
    pruning = instantiate(cfg.callbacks.optuna_pruning)
    assert isinstance(pruning.pruner, optuna.pruners.MedianPruner)
    assert pruning.url.endswith("multirun/optuna_synthetic/optuna.db")


def _outputs(nb) -> tuple[str, list[int]]:
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []))
    images = [sum("image/png" in o.get("data", {}) for o in c.get("outputs", []))
              for c in nb.cells if c.cell_type == "code"]
    return text, images


def _execute(name: str, tmp: Path, monkeypatch, **env: str):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(REPO / "notebooks" / name, as_version=4)
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend: images out
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    NotebookClient(nb, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp)}}).execute()
    return _outputs(nb)


@pytest.mark.slow  # make test-slow: a notebook, run in a kernel of its own
def test_visualize_notebook_shows_legend_error_map_iou_and_tile_zoom(killed_sweep, monkeypatch):
    text, images = _execute("visualize_predictions.ipynb", killed_sweep.tmp, monkeypatch,
                            SEG_RUN=str(killed_sweep.folder / "2"))
    assert "legend: background, vegetation, water, road, building" in text
    assert "building     error" in text  # the error map's per-class table
    assert "mIoU" in text and "zoom: tile (" in text and "halo 22 px" in text
    assert images == [0, 1, 1, 1, 1, 1]  # image/truth/prediction, errors, IoU, grid, zoom


@pytest.mark.slow  # make test-slow: a notebook, run in a kernel of its own
def test_explore_sweep_notebook_shows_one_row_per_trial_and_the_best_runs(killed_sweep,
                                                                          monkeypatch):
    text, images = _execute("explore_sweep.ipynb", killed_sweep.tmp, monkeypatch,
                            SEG_SWEEP=str(killed_sweep.folder))
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("job "))
    table = lines[start + 1:lines.index("", start)]
    assert [line.split()[:2] for line in table] == [
        ["0", "complete"], ["1", "interrupted"], ["2", "complete"], ["3", "complete"]]
    assert "legend: background, vegetation, water, road, building" in text
    assert "side by side: job" in text and text.count("job ", text.index("side by side")) == 3
    assert images == [0, 0, 1, 1]  # the report figure, the predictions side by side


def test_a_launch_stopped_midway_queues_its_trials_again(tmp_path):
    """Ctrl+C of the sweeper while its Slurm jobs run (or the jobs cancelled): the trials
    are interrupted, not failed; the rerun repeats their parameters."""
    from seg_at_scale.sweeps.optuna_sweep import StudySettings, run_study

    def stopped(batch, first):
        raise KeyboardInterrupt

    space = search_space({"x": "interval(0, 1)"})
    settings = StudySettings("s", None, "maximize", "val/miou", n_trials=2, n_jobs=2, seed=0,
                             max_failures=0)
    with pytest.raises(KeyboardInterrupt):
        run_study(settings, space, tmp_path, stopped)
    study, resume = open_study(storage_url(None, tmp_path), "s", "maximize")
    assert [(t.state.name, t.user_attrs.get(INTERRUPTED)) for t in study.trials] == [
        ("FAIL", True), ("FAIL", True), ("WAITING", None), ("WAITING", None)]  # queued again
    assert (resume.finished, resume.requeued) == (0, ())  # none counted, none left running
    again = [study.ask() for _ in range(2)]
    assert [t.suggest_float("x", 0, 1) for t in again] == [t.params["x"] for t in study.trials[:2]]


def test_a_refused_trial_is_a_failed_row_and_the_swept_key_is_the_command_lines(tmp_path):
    """Before: a trial refused before its run began (``tiling.q=40`` on small images) saved
    no config and was missing from the report, whose one row then named ``model`` as the
    searched key, not the swept ``tiling.q``."""
    from seg_at_scale.sweeps.report import collect_trials

    sweep = tmp_path / "sweep"
    task = ["model=unet_tiny", "tiling=grid", "tiling.q=1,40"]
    (sweep).mkdir()
    (sweep / "multirun.yaml").write_text(
        OmegaConf.to_yaml({"hydra": {"overrides": {"task": task}}}))
    done = sweep / "0_model=unet_tiny,tiling.q=1,tiling=grid"
    (done / ".hydra").mkdir(parents=True)
    (done / ".hydra" / "overrides.yaml").write_text(
        "- model=unet_tiny\n- tiling=grid\n- tiling.q=1\n")
    (done / "summary.json").write_text(json.dumps({"val/miou": 0.5}))
    refused = sweep / "1_model=unet_tiny,tiling.q=40,tiling=grid"
    refused.mkdir()
    (refused / "train.log").write_text("seg-train: error: tiling.q=40 ...\n")
    report = collect_trials(sweep)
    assert [(r.job, r.status, r.objective, r.value_of("tiling.q")) for r in report.rows] == [
        (0, "complete", 0.5, "1"), (1, "failed", None, "40")]  # the grid's job 1
    assert report.params == ["tiling.q"] and report.best is report.rows[0]


def test_a_sweep_whose_every_trial_was_refused_still_has_a_report(tmp_path):
    """Before: with no job folder holding a saved config, the report said the folder held
    no Hydra job (FileNotFoundError), so a grid whose every trial was refused got no
    ``sweep_report.csv`` naming the refused values."""
    from seg_at_scale.sweeps.report import (
        COMMAND_FILE,
        CSV_FILE,
        PNG_FILE,
        collect_trials,
        write_report,
    )

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text(OmegaConf.to_yaml(
        {"hydra": {"overrides": {"task": ["model=unet_tiny", "tiling=grid", "tiling.q=40,50"]}}}))
    for job, q in enumerate((40, 50)):
        refused = sweep / f"{job}_model=unet_tiny,tiling.q={q},tiling=grid"
        refused.mkdir()
        (refused / "train.log").write_text(f"seg-train: error: tiling.q={q} ...\n")
    report = collect_trials(sweep)
    assert [(r.job, r.status, r.objective, r.value_of("tiling.q")) for r in report.rows] == [
        (0, "failed", None, "40"), (1, "failed", None, "50")]
    assert report.params == ["tiling.q"] and report.best is None
    write_report(sweep)  # the PNG too: a plot with no objective to draw
    assert (sweep / PNG_FILE).stat().st_size > 0
    with open(sweep / CSV_FILE) as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["status"], r["tiling.q"]) for r in rows] == [
        ("0", "failed", "40"), ("1", "failed", "50")]
    assert not (sweep / COMMAND_FILE).exists()  # no best run to repeat


def test_a_folder_of_numbered_folders_without_a_sweep_record_is_still_refused(tmp_path):
    """Numbered folders alone (no ``multirun.yaml``, no study) are not a sweep."""
    from seg_at_scale.sweeps.report import collect_trials

    (tmp_path / "0_notes").mkdir()
    with pytest.raises(FileNotFoundError, match="sweep folder"):
        collect_trials(tmp_path)


def test_a_grid_sweep_a_failed_trial_ended_still_writes_its_report(tmp_path):
    """Before: Hydra calls ``on_multirun_end`` only when every trial succeeded, so a grid
    sweep with one refused trial exited with no ``sweep_report.csv`` for the trial that
    finished; a dict value on the command line (``data.synthetic.splits={...}``) was read
    as a swept key for its commas; and the refused trial's row had no swept value."""
    folder = tmp_path / "grid"
    out = warm.run(_train_cmd("-m", *TINY, "trainer.max_epochs=1", "predict_after_fit=false",
                              "model.in_channels=4,3", f"hydra.sweep.dir={folder}"),
                   env=_env(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "model.in_channels=3 but data.bands=4" in out.stderr  # the trial's own refusal
    with open(folder / "sweep_report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["status"], r["model.in_channels"]) for r in rows] == [
        ("0", "complete", "4"), ("1", "failed", "3")]  # the grid's job 1, as Hydra made it
    assert float(rows[0]["objective"]) == pytest.approx(_miou_history(folder / rows[0]["run"])[0])
    assert "data.synthetic.splits" not in rows[0]  # one value, not a sweep
    assert (folder / "best_command.txt").read_text().strip().endswith("model.in_channels=4")
