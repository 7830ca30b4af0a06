"""The test cluster itself: what every Slurm test starts from."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slurm


def test_a_drained_node_and_a_stuck_job_are_cleared_before_the_next_test(slurm_cluster,
                                                                          jobs_env, tmp_path):
    """A node left drained (as Slurm drains one whose step it could not kill) and a two-node
    job pending behind it: ``settle`` cancels the job, resumes the node and names both."""
    slurm_cluster.client("scontrol", "update", "NodeName=n1", "State=DRAIN",
                         "Reason=left_by_a_test")
    job = slurm_cluster.sbatch(["-N2", "-o", str(tmp_path / "out"), "--wrap", "true"],
                               jobs_env)
    assert slurm_cluster.job(job)["JobState"] == "PENDING"
    problem = slurm_cluster.settle()
    assert f"{job} PENDING" in problem and "left_by_a_test" in problem, problem
    assert slurm_cluster.node_states() == {"n1": "idle", "n2": "idle"}
    assert slurm_cluster.client("squeue", "-h").stdout.strip() == ""
    assert slurm_cluster.settle() == ""  # nothing left the second time
