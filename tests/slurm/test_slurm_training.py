"""Multi-node training on the test cluster: ``sbatch -N2`` of the README's script, one gloo
rank per node, against the one-process run of the same exact tiled problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from slurm_helpers import (
    EXACT,
    SCRIPTS,
    TINY,
    assert_same_weights,
    finish,
    job_log,
    losses,
    params,
    start_reference,
)

pytestmark = pytest.mark.slurm


def test_two_nodes_train_the_one_process_steps(slurm_cluster, jobs_env, tmp_path: Path):
    """2 ranks on n1 and n2 share each image's 9 tiles (5 + 4): same losses, same weights."""
    common = [*EXACT, "trainer.max_epochs=2"]
    out = tmp_path / "job.out"
    job = slurm_cluster.sbatch(["-N2", "-o", str(out), "--chdir", str(tmp_path),
                                str(SCRIPTS / "train.sbatch"), f"hydra.run.dir={tmp_path / 'two'}",
                                *TINY, *common], jobs_env)
    ref = start_reference(tmp_path, "one", jobs_env, *common)  # meanwhile, outside Slurm
    finish(ref, tmp_path / "one.log")
    info = slurm_cluster.wait(job, timeout=300)
    log = job_log(out)
    assert (info["JobState"], info["NodeList"]) == ("COMPLETED", "n[1-2]"), log[-3000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in log  # n2's rank
    one, two = tmp_path / "one", tmp_path / "two"
    ref, got = losses(one), losses(two)
    assert (len(ref["train"]), len(ref["val"])) == (4, 2)  # 2 epochs of 2 images
    for key in ("train", "val"):
        assert got[key] == pytest.approx(ref[key], rel=1e-5)
    assert_same_weights(params(one), params(two))
    # one torch thread per rank: the task's CPUs (OMP_NUM_THREADS), not the node's cores
    assert json.loads((two / "trial.json").read_text())["threads"] == 1
