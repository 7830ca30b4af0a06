"""Multi-node training on the test cluster: ``sbatch -N2`` of the README's script, one gloo
rank per node, against the one-process run of the same exact tiled problem; and the same
job cancelled (``scancel``) mid-training, submitted again into its run folder."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from slurm_helpers import (
    EPOCHS,
    EXACT,
    SCRIPTS,
    TINY,
    assert_same_weights,
    job_log,
    losses,
    params,
)

pytestmark = pytest.mark.slurm

COMMON = [*TINY, *EXACT, f"trainer.max_epochs={EPOCHS}"]
HERE = Path(__file__).resolve().parent


@pytest.mark.slow  # its weights are also proven by the cancelled and the requeued job's tests
def test_two_nodes_train_the_one_process_steps(slurm_cluster, jobs_env, reference,
                                               tmp_path: Path):
    """2 ranks on n1 and n2 share each image's 9 tiles (5 + 4): same losses, same weights."""
    out, run = tmp_path / "job.out", tmp_path / "two"
    job = slurm_cluster.sbatch(["-N2", "-o", str(out), "--chdir", str(tmp_path),
                                str(SCRIPTS / "train.sbatch"), f"hydra.run.dir={run}",
                                *COMMON], jobs_env)
    one = reference()  # trained meanwhile
    info = slurm_cluster.wait(job, timeout=300)
    log = job_log(out)
    assert (info["JobState"], info["NodeList"]) == ("COMPLETED", "n[1-2]"), log[-3000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in log  # n2's rank
    ref, got = losses(one), losses(run)
    assert (len(ref["train"]), len(ref["val"])) == (2 * EPOCHS, EPOCHS)  # 2 images an epoch
    for key in ("train", "val"):
        assert got[key] == pytest.approx(ref[key], rel=1e-5)
    assert_same_weights(params(one), params(run))
    # one torch thread per rank: the task's CPUs (OMP_NUM_THREADS), not the node's cores
    assert json.loads((run / "trial.json").read_text())["threads"] == 1


def test_a_cancelled_two_node_job_resumes_in_its_folder_to_the_same_weights(
        slurm_cluster, jobs_env, reference, tmp_path: Path):
    """``scancel`` mid-training: both ranks stop together at an image's end, exit 143 with
    ``last.ckpt`` (was: rank 1 failed on a gloo error, or both hung until SIGKILL); the
    job submitted again with ``hydra.run.dir`` ends with the one-process weights."""
    run = tmp_path / "two"
    args = ["-N2", "--chdir", str(tmp_path), str(SCRIPTS / "train.sbatch"),
            f"hydra.run.dir={run}", *COMMON, "+callbacks.pace._target_=pacing.Pace"]
    env = {**jobs_env, "PYTHONPATH": f"{jobs_env['PYTHONPATH']}:{HERE}"}
    first = slurm_cluster.sbatch(["-o", str(tmp_path / "first.out"), *args],
                                 {**env, "SEG_TEST_PACE_S": "0.1"})
    last = run / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 120
    while not last.exists():  # the first epoch is done
        assert time.monotonic() < deadline, job_log(tmp_path / "first.out")[-3000:]
        time.sleep(0.1)
    slurm_cluster.client("scancel", str(first))
    info = slurm_cluster.wait(first, timeout=60)
    log = job_log(tmp_path / "first.out")
    assert info["JobState"] == "CANCELLED" and "stopped by SIGTERM" in log, log[-3000:]
    assert log.count("Exited with exit code 143") == 2, log[-3000:]  # both ranks, cleanly
    saved = torch.load(last, map_location="cpu", weights_only=True)
    done = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"]
    assert done % 5 == 0 and saved["global_step"] < 2 * EPOCHS  # an image's end, mid-run

    again = slurm_cluster.sbatch(["-o", str(tmp_path / "again.out"), *args], env)
    info = slurm_cluster.wait(again, timeout=300)
    log = job_log(tmp_path / "again.out")
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert f"Restoring states from the checkpoint path at {last}" in log
    # the job's file shows the epochs as they end: rank 0's line each, not a bar
    epochs = re.findall(rf"epoch (\d+)/{EPOCHS} \(\d+ steps, ", log)
    assert epochs and epochs[-1] == str(EPOCHS) and len(set(epochs)) == len(epochs), log[-3000:]
    resumed = torch.load(last, map_location="cpu", weights_only=True)
    assert resumed["global_step"] == 2 * EPOCHS
    assert_same_weights(params(reference()), params(run))
