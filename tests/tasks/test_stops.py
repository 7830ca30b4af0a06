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

import pytest
import torch
from helpers import warm
from helpers.cli import run_train

from seg_at_scale.tasks.interrupt import SaveOnStop, newest_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TINY = ["trainer=fast", "logger=csv", "model=unet_tiny", "data.synthetic.height=157",
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
    return warm.popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp,
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
    saved = torch.load(last, map_location="cpu", weights_only=True)
    again = run_train(tmp_path, "run", *TINY, f"trainer.max_epochs={saved['epoch'] + 2}")
    assert f"Restoring states from the checkpoint path at {last}" in again["log"]
    resumed = torch.load(last, map_location="cpu", weights_only=True)
    assert resumed["global_step"] > saved["global_step"]  # it went on from there (how far
    # depends on where in an epoch the signal landed: a mid-epoch stop resumes mid-epoch)


def fake_slurm(tmp: Path) -> dict[str, str]:
    """The environment of SLURM job 4242, with a stand-in scontrol that records requeues."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp / 'requeued'}\n")
    scontrol.chmod(0o755)
    return {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "seg", "SLURM_JOB_ID": "4242",
            "SLURM_NODELIST": "localhost", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
            "SLURM_NODEID": "0", "PATH": f"{bin_dir}:/usr/bin:/bin"}


def test_slurm_requeue_then_sigterm_then_the_requeued_job_resumes(tmp_path: Path) -> None:
    slurm = fake_slurm(tmp_path)
    proc = start(tmp_path, "trainer.max_epochs=1000", env=slurm)
    run = tmp_path / "runs" / "same_unet_tiny" / "4242"  # the job id names the run folder
    last = run / "checkpoints" / "last.ckpt"
    wait_for(last, proc)
    proc.send_signal(signal.SIGUSR1)  # sbatch --signal=USR1@90: Lightning's requeue
    end = time.monotonic() + 60
    while not (tmp_path / "requeued").exists() and time.monotonic() < end:
        time.sleep(0.2)
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "4242"]
    assert (run / "hpc_ckpt_1.ckpt").exists()
    proc.send_signal(signal.SIGTERM)  # what SLURM sends the job it requeues
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    log = (tmp_path / "out.txt").read_text()
    assert "stopped by SIGTERM" in log and "Traceback" not in log
    assert newest_checkpoint(run) == last  # written after the HPC checkpoint
    saved = torch.load(last, map_location="cpu", weights_only=True)

    requeued = start(tmp_path, f"trainer.max_epochs={saved['epoch'] + 2}", env=slurm)
    assert requeued.wait(timeout=300) == 0
    log = (tmp_path / "out.txt").read_text()
    assert f"Restoring states from the checkpoint path at {last}" in log
    resumed = torch.load(last, map_location="cpu", weights_only=True)
    assert resumed["global_step"] > saved["global_step"]  # it went on from there (how far
    # depends on where in an epoch the signal landed: a mid-epoch stop resumes mid-epoch)
    os.utime(run / "hpc_ckpt_1.ckpt")
    assert newest_checkpoint(run) == run / "hpc_ckpt_1.ckpt"  # the newer one wins


def test_first_ctrl_c_stops_like_sigterm_the_second_at_once(monkeypatch) -> None:
    calls = []
    before = signal.getsignal(signal.SIGINT)  # ignored when the suite runs in the background
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    stop = SaveOnStop("unused")
    try:
        stop.setup(None, None, "fit")  # type: ignore[arg-type]
        os.kill(os.getpid(), signal.SIGINT)
        assert calls == [signal.SIGTERM] and stop.signal == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.teardown(None, None, "fit")  # type: ignore[arg-type]
        signal.signal(signal.SIGTERM, previous)
    assert signal.getsignal(signal.SIGINT) is before  # restored


GRID = ["logger=csv", "model=unet_tiny", "data.synthetic.height=157", "data.synthetic.width=189",
        "data.synthetic.splits={train:2,val:1,test:1}", "trainer.enable_progress_bar=false",
        "trainer.num_sanity_val_steps=0", "tiling=grid", "tiling.q=3", "predict_after_fit=false",
        "task.optimizer._target_=torch.optim.SGD", "~task.optimizer.weight_decay",
        "task.optimizer.lr=0.05", "task.scheduler=null", "trainer.max_epochs=2",
        "+callbacks.stop._target_=helpers.stop_callbacks.SignalAt"]


def test_a_stop_inside_an_image_resumes_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    """Grid mode, SIGTERM at tile 6 of epoch 1's first image (9 tiles): the stop waits for
    the image's last tile (its gradient is in memory only), the rerun leaves out the 9
    batches done, and the weights are the uninterrupted run's, bit for bit."""
    env = {"SEG_DATA_DIR": str(tmp_path / "data"), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "WANDB_MODE": "offline"}

    def train(run: str, **extra: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "seg_at_scale.cli.train", *GRID,
               f"hydra.run.dir={tmp_path / run}"]
        return warm.popen(cmd, env={**env, **extra}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)

    ref = train("ref")
    stopped = train("run", SEG_TEST_STOP_AT="1:5")
    log = stopped.communicate(timeout=300)[0]
    assert stopped.returncode == 128 + signal.SIGTERM, log[-3000:]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=True)
    progress = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
    assert (saved["epoch"], saved["global_step"], progress["completed"]) == (1, 3, 9)
    again = train("run")
    log = again.communicate(timeout=300)[0]
    assert again.returncode == 0 and "resuming epoch 1 after its first 9 batches" in log, log
    assert ref.communicate(timeout=300)[0] and ref.returncode == 0
    a, b = (torch.load(tmp_path / r / "checkpoints" / "last.ckpt", map_location="cpu",
                       weights_only=True) for r in ("ref", "run"))
    # last.ckpt is the end of training, whether or not val/miou improved in the last epoch
    assert a["global_step"] == b["global_step"] == 4
    for k, v in a["state_dict"].items():
        assert torch.equal(b["state_dict"][k], v), k


def test_a_second_sigterm_while_the_stopped_run_exits_does_not_kill_it(tmp_path: Path) -> None:
    """A Slurm step's cancel signals its processes more than once: a second SIGTERM that
    came while a stopped rank exited, after its checkpoint and once Lightning had put the
    default handler back, killed it ("task 1: Terminated", not exit 143). Once stopping,
    the run exits 143 with its checkpoint whatever SIGTERMs follow."""
    env = {"SEG_DATA_DIR": str(tmp_path / "data"), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "WANDB_MODE": "offline",
           "SEG_TEST_STOP_AT": "0:4", "SEG_TEST_STOP_AGAIN": "1"}
    cmd = [sys.executable, "-m", "seg_at_scale.cli.train", *GRID,
           f"hydra.run.dir={tmp_path / 'run'}"]
    proc = warm.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = proc.communicate(timeout=300)[0]
    assert "a second SIGTERM while exiting" in log, log[-3000:]
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, log[-3000:])
    assert "stopped by SIGTERM at epoch 0, step 1" in log
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu",
                       weights_only=True)
    assert (saved["epoch"], saved["global_step"]) == (0, 1)  # the first image's step


def test_a_sigkilled_run_with_loader_workers_resumes_to_the_uninterrupted_weights(
        tmp_path: Path) -> None:
    """SIGKILL (the OOM killer, a lost node) leaves each epoch's ``last.ckpt``; the rerun
    resumes from it. Before: with data-loader workers the resumed run drew its first epoch's
    tiles before Lightning set the sampler's epoch, trained on epoch 0's tiles again, and
    ended on other weights than the uninterrupted run."""
    args = ["data.num_workers=2", "trainer.max_epochs=6"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ref = start(tmp_path / "a", *args, run_dir=tmp_path / "ref")
    run = tmp_path / "run"
    victim = start(tmp_path / "b", *args, run_dir=run)
    last, seen, stamp = run / "checkpoints" / "last.ckpt", 0, None
    end = time.monotonic() + 240
    while seen < 2:  # two epochs' checkpoints written: killed inside a later epoch
        assert victim.poll() is None and time.monotonic() < end, "ended before the kill"
        now = last.stat().st_mtime_ns if last.exists() else None
        if now is not None and now != stamp:
            seen, stamp = seen + 1, now
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(60) == -signal.SIGKILL
    again = start(tmp_path / "b", *args, run_dir=run)
    assert again.wait(300) == 0, (tmp_path / "b" / "out.txt").read_text()[-3000:]
    assert "Restored all states from the checkpoint" in (tmp_path / "b" / "out.txt").read_text()
    assert ref.wait(300) == 0, (tmp_path / "a" / "out.txt").read_text()
    a, b = (torch.load(p / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
            for p in (tmp_path / "ref", run))
    assert a["global_step"] == b["global_step"] == 24
    for k, v in a["state_dict"].items():
        assert torch.equal(b["state_dict"][k], v), k
