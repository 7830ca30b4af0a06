"""An optuna sweep through ``hydra/launcher=slurm``: trials as Slurm jobs side by side, the
sweep cancelled (``scancel`` of its jobs, Ctrl+C of the sweeper) and run again to the end."""

from __future__ import annotations

import csv
import json
import re
import signal
import subprocess
import time
import warnings
from datetime import datetime
from pathlib import Path

import optuna
import pytest

from seg_at_scale.cli.malloc import find_tcmalloc
from seg_at_scale.sweeps.report import collect_trials
from seg_at_scale.sweeps.study import INTERRUPTED

pytestmark = pytest.mark.slurm

# tests/sweeps/test_sweeps.py's tiny search: 2 trials of 2 short epochs
SEARCH = ["hparams_search=optuna", "trainer=fast", "logger=csv", "model=unet_tiny",
          "data.synthetic.height=157", "data.synthetic.width=189",
          "data.synthetic.splits={train:2,val:1,test:1}", "tiling.tile_size=256",
          "predict.tile_size=96", "predict_after_fit=false", "trainer.max_epochs=2",
          "trainer.limit_train_batches=3", "tiling.core_size=choice(32,48)",
          "tiling.batch_size=choice(2,4)", "task.optimizer.lr=tag(log,interval(0.003,0.1))",
          "hydra.sweeper.n_trials=2", "hydra.sweeper.study_name=s"]
# trials as Slurm jobs, 2 at a time; submitit's slurm.yaml asks for GPUs and 8 CPUs per task
SLURM = ["hydra/launcher=slurm", "hydra.sweeper.n_jobs=2", "hydra.launcher.gpus_per_node=null",
         "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1"]


def _times(info: dict[str, str]) -> tuple[datetime, datetime]:
    return (datetime.fromisoformat(info["StartTime"]), datetime.fromisoformat(info["EndTime"]))


def _array_tasks(folder: Path) -> list[str]:
    """The sweep's job array tasks ``<array id>_<task>`` (submitit's folders)."""
    return sorted(p.name for p in (folder / ".submitit").iterdir()
                  if re.fullmatch(r"\d+_\d+", p.name))


def _miou_history(run: Path) -> list[float]:
    with open(run / "csv" / "version_0" / "metrics.csv") as f:
        return [float(m["val/miou"]) for m in csv.DictReader(f) if m["val/miou"]]


def _ctrl_c_as_at_a_terminal() -> None:
    """SIGINT as a terminal's command gets it (a suite started in the background by a
    non-interactive shell inherits SIGINT ignored, and the Ctrl+C below would be lost)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_cancelled_slurm_sweep_resumes_and_reports_every_trial(
        slurm_cluster, jobs_env, console_scripts, tmp_path: Path):
    folder = tmp_path / "sweep"
    cmd = [str(console_scripts / "seg-train"), "-m", *SEARCH, *SLURM,
           f"hydra.sweep.dir={folder}"]
    env = {**jobs_env, **slurm_cluster.env}
    first = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True,
                             preexec_fn=_ctrl_c_as_at_a_terminal)
    deadline = time.monotonic() + 120
    # both trials running in their jobs (hydra writes a trial's .hydra in the job; a cancel
    # while Slurm still launches the step is Slurm's own race, not the sweep's)
    while not all((folder / t / ".hydra" / "config.yaml").exists() for t in "01"):
        assert first.poll() is None and time.monotonic() < deadline, "trials never started"
        time.sleep(0.1)
    (array,) = {t.split("_")[0] for t in _array_tasks(folder)}
    slurm_cluster.client("scancel", array)  # the sweep's jobs ...
    first.send_signal(signal.SIGINT)  # ... and its command (Ctrl+C), waiting for them
    log = first.communicate(timeout=60)[0]
    assert first.returncode != 0
    assert "sweep stopped while trials [0, 1] ran: marked interrupted" in log, log[-3000:]
    # the rerun's trials need both nodes: wait until the cancelled steps are gone (a node
    # Slurm drained for a step it could not kill in time is resumed, with a warning)
    problem = slurm_cluster.settle()
    if problem:
        warnings.warn(f"after the cancelled sweep: {problem}", stacklevel=1)

    again = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "0 finished trials stored, 2 to run, 2 at a time" in again.stdout + again.stderr
    trials = optuna.load_study(study_name="s",
                               storage=f"sqlite:///{folder / 'optuna.db'}").trials
    assert [t.state.name for t in trials] == ["FAIL", "FAIL", "COMPLETE", "COMPLETE"]
    assert trials[0].user_attrs[INTERRUPTED] and trials[1].user_attrs[INTERRUPTED]
    assert [t.params for t in trials[2:]] == [t.params for t in trials[:2]]  # repeated
    # the rerun's two trials: one job array, a task on each node, running at once
    tasks = [t for t in _array_tasks(folder) if t.split("_")[0] != array]
    infos = [slurm_cluster.job(t) for t in tasks]
    assert sorted(i["NodeList"] for i in infos) == ["n1", "n2"], tasks
    (s0, e0), (s1, e1) = (_times(i) for i in infos)
    assert s0 < e1 and s1 < e0  # side by side

    with open(folder / "sweep_report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["status"]) for r in rows] == [
        ("0", "interrupted"), ("1", "interrupted"), ("2", "complete"), ("3", "complete")]
    for r in rows[2:]:
        own = _miou_history(folder / r["job"])
        assert len(own) == 2 and float(r["objective"]) == pytest.approx(max(own), rel=1e-6)
        # the command's tcmalloc reached its jobs (sbatch exports the environment)
        summary = json.loads((folder / r["job"] / "summary.json").read_text())
        assert summary["allocator"] == ("tcmalloc" if find_tcmalloc() else "system")
    report = collect_trials(folder)
    command = (folder / "best_command.txt").read_text()
    assert command.startswith("seg-train ") and "hparams_search" not in command
    assert "hydra/launcher" not in command
    assert f"task.optimizer.lr={report.best.value_of('task.optimizer.lr')}" in command
