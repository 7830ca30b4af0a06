"""Stopping training without losing it: Ctrl+C and SIGTERM save a checkpoint that a rerun
resumes from; under SLURM the requeue signal saves Lightning's HPC checkpoint and requeues
the job into the same run folder. Real signals to real ``seg-train`` processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from conftest import run_train

ROOT = Path(__file__).resolve().parents[1]
TINY = ["trainer=fast", "logger=csv", "model_size=tiny", "data.synthetic.height=157",
        "data.synthetic.width=189", "data.synthetic.splits={train:2,val:1,test:1}",
        "tiling.tile_size=96", "predict_after_fit=false", "tiling.samples_per_epoch=16",
        "tiling.batch_size=2", "trainer.limit_train_batches=4", "trainer.limit_val_batches=1"]


def start(tmp: Path, *overrides: str, env: dict[str, str] | None = None,
          run_dir: Path | None = None) -> subprocess.Popen:
    """``seg-train`` running in the background (output in ``tmp/out.txt``)."""
    cmd = [sys.executable, "-m", "seg_at_scale.cli.train", *TINY, *overrides]
    if run_dir is not None:
        cmd.append(f"hydra.run.dir={run_dir}")
    base = {"SEG_DATA_DIR": str(tmp / "data"), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
            "WANDB_MODE": "offline"}
    out = open(tmp / "out.txt", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp,
                            env={**base, **(env or {})})


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Until ``path`` exists (training is past its first epoch); fails if the run ends."""
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, "training ended before the signal"
        assert time.monotonic() < end, f"no {path} after {timeout} s"
        time.sleep(0.2)
    time.sleep(0.5)  # written completely, and into the next epoch


def test_ctrl_c_saves_a_checkpoint_and_a_rerun_resumes_from_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start(tmp_path, "trainer.max_epochs=1000", run_dir=run)
    last = run / "checkpoints" / "last.ckpt"
    wait_for(last, proc)
    epoch_end = last.stat().st_mtime_ns
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 128 + signal.SIGINT
    log = (tmp_path / "out.txt").read_text()
    assert "stopped by SIGINT" in log and "Traceback" not in log
    assert last.stat().st_mtime_ns > epoch_end  # saved by the stop, not the epoch's end
    saved = torch.load(last, map_location="cpu", weights_only=False)
    assert saved["global_step"] >= 4

    again = run_train(tmp_path, "run", *TINY, f"trainer.max_epochs={saved['epoch'] + 2}")
    assert f"Restoring states from the checkpoint path at {last}" in again["log"]
    resumed = torch.load(last, map_location="cpu", weights_only=False)
    assert resumed["global_step"] >= saved["global_step"] + 4  # it went on from there


def test_slurm_requeue_and_sigterm_save_checkpoints_in_the_job_folder(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"  # a stand-in scontrol that records the requeue
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'requeued'}\n")
    scontrol.chmod(0o755)
    slurm = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "seg", "SLURM_JOB_ID": "4242",
             "SLURM_NODELIST": "localhost", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
             "SLURM_NODEID": "0", "PATH": f"{bin_dir}:/usr/bin:/bin"}
    proc = start(tmp_path, "trainer.max_epochs=1000", env=slurm)
    run = tmp_path / "runs" / "same_tiny" / "4242"  # the job id names the run folder
    wait_for(run / "checkpoints" / "last.ckpt", proc)
    proc.send_signal(signal.SIGUSR1)  # sbatch --signal=USR1@90
    end = time.monotonic() + 60
    while not (tmp_path / "requeued").exists() and time.monotonic() < end:
        time.sleep(0.2)
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "4242"]
    assert (run / "hpc_ckpt_1.ckpt").exists()
    proc.send_signal(signal.SIGTERM)  # what SLURM sends the requeued job
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in (tmp_path / "out.txt").read_text()
    from seg_at_scale.tasks.interrupt import newest_checkpoint

    assert newest_checkpoint(run) == run / "checkpoints" / "last.ckpt"  # the later one
    os.utime(run / "hpc_ckpt_1.ckpt")
    assert newest_checkpoint(run) == run / "hpc_ckpt_1.ckpt"
