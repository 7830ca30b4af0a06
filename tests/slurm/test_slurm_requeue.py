"""Requeue for real, on two nodes: Slurm's time-limit signal (``--signal=USR1@90``),
Lightning's HPC checkpoint and ``scontrol requeue``, the requeued job resuming in its run
folder ``runs/<run_name>/<job id>`` to the weights of an uninterrupted one-process run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from slurm_helpers import EPOCHS, EXACT, SCRIPTS, TINY, assert_same_weights, job_log, params

pytestmark = pytest.mark.slurm

# the training tests' exact problem (5 slots an image on each of 2 ranks); the first run
# paced to ~20 s an epoch (100 s in all): still training when the signal comes, due at the
# controller's next time-limit check (every 30 s, later on a loaded machine); the requeued
# run not paced
REQUEUE = [*TINY, *EXACT, f"trainer.max_epochs={EPOCHS}", "+callbacks.pace._target_=pacing.Pace"]


def wait_for(check, timeout: float, what: str, state=lambda: ""):
    end = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < end, f"no {what} after {timeout} s\n{state()}"
        time.sleep(0.2)
    return found


def test_time_limit_signal_requeues_and_the_job_resumes_to_the_same_weights(
        slurm_cluster, jobs_env, reference, tmp_path: Path):
    started = tmp_path / "training"
    env = {**jobs_env, "PYTHONPATH": f"{jobs_env['PYTHONPATH']}:{Path(__file__).parent}",
           "SEG_TEST_PACE_S": "2", "SEG_TEST_STARTED": str(started)}
    out = tmp_path / "job.out"
    job = slurm_cluster.sbatch(["-N2", "--time=10", "-o", str(out), "--chdir", str(tmp_path),
                                str(SCRIPTS / "train.sbatch"), *REQUEUE], env)
    run = tmp_path / "runs" / "same_unet_tiny" / str(job)  # the job id names the run folder
    wait_for(lambda: started.exists() or
             slurm_cluster.job(job)["JobState"] not in ("PENDING", "RUNNING"), 120,
             "training")
    # a short time limit now that training runs: USR1 is due (90 s before the limit); the
    # limit itself far enough that a late check still signals rather than times the job out
    slurm_cluster.client("scontrol", "update", f"JobId={job}", "TimeLimit=2")
    wait_for(lambda: slurm_cluster.job(job)["Restarts"] == "1", 150, "requeue",
             lambda: (f"{slurm_cluster.job(job)}\n{job_log(out)[-1500:]}\n"
                      f"{slurm_cluster.log_tail('slurmctld', 30)}"))
    wait_for(lambda: slurm_cluster.job(job)["JobState"] == "PENDING", 60, "pending again")
    # Slurm holds a requeued job for 120 s (BeginTime): start it now, with its time limit
    # back (a limit it has passed would have the new run signalled before Lightning is up)
    slurm_cluster.client("scontrol", "update", f"JobId={job}", "StartTime=now", "TimeLimit=10")
    info = slurm_cluster.wait(job, timeout=240)
    log = job_log(out)
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), log[-3000:]
    assert "Handling auto-requeue signal: 10" in log and f"Requeued SLURM job: {job}" in log
    assert "stopped by SIGTERM" in log  # the requeue's SIGTERM: last.ckpt at an image end
    assert log.count("Exited with exit code 143") == 2  # both ranks, together
    last = run / "checkpoints" / "last.ckpt"
    assert f"Restoring states from the checkpoint path at {last}" in log
    assert (run / ".hydra" / "resume_1").is_dir()
    hpc = torch.load(run / "hpc_ckpt_1.ckpt", map_location="cpu", weights_only=True)
    done = hpc["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"]
    assert done % 5 == 0  # saved at an image's end (5 slots a rank), not inside one
    completions = [line for line in (slurm_cluster.root / "log" / "jobcomp.txt").read_text()
                   .splitlines() if line.startswith(f"JobId={job} ")]
    assert len(completions) == 2 and "JobState=COMPLETED" in completions[-1]
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == EPOCHS * 2  # every image of every epoch stepped once
    assert_same_weights(params(reference()), params(run))
