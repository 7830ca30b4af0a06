"""Two-node prediction on the test cluster: ``nodes=2 processes=1`` ranks share one raster's
tiles and write the one-process output's bytes: the README's sbatch script with a rank
killed, then the same prediction through ``hydra/launcher=slurm_predict``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.prediction import chunks_written, seg_predict
from slurm_helpers import SCRIPTS, job_log

pytestmark = pytest.mark.slurm

TILES = ["tile_size=64", "progress=false"]
# submitit's launcher asks for GPUs, 8 CPUs and 64 GB per node: the test nodes have 1 CPU
CPU_CLUSTER = ["hydra.launcher.gpus_per_node=null", "hydra.launcher.cpus_per_task=1",
               "hydra.launcher.mem_gb=1"]


@pytest.fixture(scope="module")
def cli_case(tmp_path_factory):
    """tests/conftest.py's run and a larger scene, 517 x 743: 1551 tiles of 64, so that the
    rank killed after 20 finished tiles still has most of its share left."""
    from helpers.prediction import make_image, make_model, make_run

    tmp = tmp_path_factory.mktemp("cli")
    run = make_run(tmp / "run", make_model("same", levels=3, width=8))
    return run, make_image(tmp / "scene.tif", 517, 743)


@pytest.fixture(scope="module")
def reference(cli_case, tmp_path_factory) -> Path:
    """The one-process prediction of the test scene (a COG)."""
    run, image = cli_case
    out = tmp_path_factory.mktemp("one") / "mask.tif"
    seg_predict(run, image, out, *TILES)
    return out


def result_of(log: str) -> dict:
    """Rank 0's summary (the JSON seg-predict prints)."""
    return json.loads(log[log.index("{\n"):log.rindex("}") + 1])


def rank_pid(job: int, rank: int) -> int | None:
    """The pid of a job's ``seg-predict`` rank (its environment names job and rank)."""
    want = {b"SLURM_JOB_ID=%d" % job, b"SLURM_PROCID=%d" % rank}
    for entry in Path("/proc").iterdir():
        try:
            environ = set((entry / "environ").read_bytes().split(b"\0"))
            cmd = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if want <= environ and b"seg-predict" in cmd:
            return int(entry.name)
    return None


def test_a_killed_rank_fails_the_job_and_the_launcher_completes_the_bytes(
        slurm_cluster, jobs_env, console_scripts, cli_case, reference, tmp_path: Path):
    """The README's sbatch script on two nodes, its rank on n2 SIGKILLed mid-prediction (a
    node's task lost): rank 0 fails at its next collective, the job fails, no output. The
    same prediction again through ``seg-predict -m hydra/launcher=slurm_predict nodes=2
    processes=1`` (submitit: one two-node job) resumes from the finished tiles and writes
    the one-process bytes."""
    run, image = cli_case
    out = tmp_path / "two" / "mask.tif"
    out.parent.mkdir()
    keys = [f"run={run}", f"image={image}", f"output={out}", *TILES]
    first = slurm_cluster.sbatch(["-o", str(tmp_path / "first.out"),
                                  str(SCRIPTS / "predict.sbatch"), *keys], jobs_env)
    store = out.with_name(".mask.tif.zarr")
    deadline = time.monotonic() + 120
    while chunks_written(store) < 20:
        assert time.monotonic() < deadline, job_log(tmp_path / "first.out")[-3000:]
        time.sleep(0.01)
    pid = rank_pid(first, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    info = slurm_cluster.wait(first, timeout=120)
    log = job_log(tmp_path / "first.out")
    assert (info["JobState"], info["NodeList"]) == ("FAILED", "n[1-2]") and not out.exists()
    # rank 0's gloo names the lost peer ("closed" or "reset", as the kill lands); srun
    # reports the killed task, or, when rank 0's failure reaches it first, that one and
    # ends the step
    assert re.search(r"Connection (closed|reset) by peer", log), log[-3000:]
    assert "task 1: Killed" in log or ("task 0: Exited with exit code 1" in log
                                       and "Force Terminated" in log), log[-3000:]
    done = chunks_written(store)

    sweep = tmp_path / "sweep"
    cmd = [str(console_scripts / "seg-predict"), "-m", "hydra/launcher=slurm_predict",
           "nodes=2", "processes=1", *CPU_CLUSTER, f"hydra.sweep.dir={sweep}", *keys]
    again = subprocess.run(cmd, env={**jobs_env, **slurm_cluster.env}, cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    (job,) = [int(p.name) for p in (sweep / ".submitit").iterdir() if p.name.isdigit()]
    info = slurm_cluster.wait(job, timeout=60)  # the ranks have sent their results
    assert (info["JobState"], info["NodeList"], info["NumTasks"]) == ("COMPLETED", "n[1-2]",
                                                                      "2")
    res = result_of((sweep / ".submitit" / str(job) / f"{job}_0_log.out").read_text())
    assert res["processes"] == 2 and res["tiles_resumed"] >= done - 2 > 0
    assert out.read_bytes() == reference.read_bytes()
    # one torch thread per CPU of a task (slurm_predict.yaml's setup), not one per core
    script = (sweep / ".submitit" / str(job) / f"{job}_submission.sh").read_text()
    assert "export OMP_NUM_THREADS=1\n" in script


def test_an_archive_on_two_nodes_equals_one_process(slurm_cluster, jobs_env, cli_case,
                                                    tmp_path: Path):
    """``images=`` through the README's sbatch script on two nodes: one work queue over the
    scenes and both nodes' ranks, every scene's bytes those of the one-process archive."""
    import csv

    from helpers.prediction import make_image, seg_predict_here

    run, _ = cli_case
    scenes = tmp_path / "scenes"
    scenes.mkdir()
    for k, (h, w) in enumerate([(203, 171), (97, 131), (151, 229)]):
        make_image(scenes / f"s{k}.tif", h, w, seed=k + 2)
    keys = [f"run={run}", f"images={scenes}", *TILES, "preview=false", "stac=false"]
    one = seg_predict_here(*keys, f"output_dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-3000:]
    job = slurm_cluster.sbatch(["-o", str(tmp_path / "two.out"), str(SCRIPTS / "predict.sbatch"),
                                *keys, f"output_dir={tmp_path / 'two'}"], jobs_env)
    info = slurm_cluster.wait(job, timeout=180)
    log = job_log(tmp_path / "two.out")
    assert (info["JobState"], info["NodeList"]) == ("COMPLETED", "n[1-2]"), log[-3000:]
    for k in range(3):
        name = f"s{k}.tif"
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()
    with (tmp_path / "two" / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["status"] for r in rows} == {"done"} and len(rows) == 3
    by_rank = [json.loads(r["tiles_by_rank"]) for r in rows]
    assert all(len(t) == 2 for t in by_rank)
    assert sum(t[0] for t in by_rank) > 0 and sum(t[1] for t in by_rank) > 0  # both nodes
