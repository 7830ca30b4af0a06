"""Local ranks of ``seg-predict processes=N`` are forked from the command's process: they
run OpenMP, give the one-process output, and stop together on SIGTERM, resumably."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import warm
from helpers.prediction import chunks_written, env, predict_cmd, seg_predict

from seg_at_scale.io import read_raster


# seg-predict on a machine that reports 4 cores (tests/helpers/four_cores.py)
def _forked_cmd(run, image, out, *overrides):
    return [sys.executable, "-m", "helpers.four_cores", *predict_cmd(run, image, out,
                                                                      *overrides)[3:]]


def _env_without_thread_count():
    return {**{k: v for k, v in env().items() if k != "OMP_NUM_THREADS"},
            "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def test_forked_ranks_run_openmp_and_equal_one_process(cli_case, tmp_path):
    run, image = cli_case
    ref = tmp_path / "one" / "mask.zarr"  # one process with each rank's 2 threads: oneDNN's
    # float32 sums may round differently with another thread count (seen on AMD EPYC)
    proc = warm.run(predict_cmd(run, image, ref, "tile_size=96", "probabilities=uint8"),
                    capture_output=True, text=True,
                    env={**env(), "OMP_NUM_THREADS": "2"}, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "two" / "mask.zarr"
    proc = warm.run(_forked_cmd(run, image, out, "tile_size=96", "processes=2",
                                      "probabilities=uint8"),
                    capture_output=True, text=True, env=_env_without_thread_count(),
                    timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert res["processes"] == 2 and res["threads"] == 2
    assert res["tiles_computed"] < res["tiles"]  # rank 0's share only
    for name in ("labels", "probabilities"):
        for chunk in (ref / name / "c").rglob("*"):
            if chunk.is_file():
                twin = out / name / "c" / chunk.relative_to(ref / name / "c")
                assert twin.read_bytes() == chunk.read_bytes(), twin


def test_forked_ranks_refuse_bad_input_once(cli_case, tmp_path):
    run, image = cli_case
    proc = warm.run(_forked_cmd(run, image, tmp_path / "m.tif", "processes=2", "q=1"),
                    capture_output=True, text=True, env=_env_without_thread_count(),
                    timeout=240)
    assert proc.returncode == 2
    # checked before any rank is forked: one line, no torch or Lightning lines around it
    assert proc.stderr.strip().splitlines() == [
        f"seg-predict: error: processes=2 but the grid of '{image}' has only 1 batch of "
        "tiles (1 tile); use processes <= 1, or smaller tiles (tile_size or q)"], proc.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_launcher_stops_every_rank_and_the_rerun_completes(cli_case, cli_reference,
                                                                    tmp_path, sig):
    """SIGTERM or SIGKILL to the launching process alone (``kill PID``, the OOM killer):
    no rank goes on; after SIGTERM it exits 143 with the resume hint; the same command
    completes the prediction with the uninterrupted bytes."""
    run, image = cli_case
    ref = cli_reference
    out = tmp_path / "killed" / "mask.tif"
    out.parent.mkdir()
    cmd = predict_cmd(run, image, out, "tile_size=64", "processes=2")
    proc = warm.popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    store = out.with_name(".mask.tif.zarr")
    deadline = time.time() + 120
    ranks: list[psutil.Process] = []
    while len(ranks) < 2 and time.time() < deadline and proc.poll() is None:
        ranks = psutil.Process(proc.pid).children()
        time.sleep(0.002)
    assert len(ranks) == 2
    # the ranks run in steps of 20 ms, held still in between, until 4 tiles are written,
    # and are held while the launcher takes the signal: the stop lands mid-run however
    # loaded the machine (408 tiles take them about a second; under a full suite's load
    # they once finished every tile before a free-running watch saw 4, and the rerun below
    # found no work); a rank that went on after the stop would finish them once resumed
    for r in ranks:
        r.suspend()
    while chunks_written(store) < 4 and time.time() < deadline:
        for r in ranks:
            r.resume()
        time.sleep(0.02)
        for r in ranks:
            r.suspend()
    proc.send_signal(sig)
    time.sleep(0.3)
    for r in ranks:
        with contextlib.suppress(psutil.NoSuchProcess):
            r.resume()
    proc.wait(60)
    assert proc.returncode == (143 if sig == signal.SIGTERM else -9) and not out.exists()
    if sig == signal.SIGTERM:
        assert "run the same command again to resume" in proc.stderr.read().decode()
    psutil.wait_procs(ranks, timeout=20)
    assert not any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in ranks)
    done = chunks_written(store)
    res = seg_predict(run, image, out, "tile_size=64", "processes=2")
    assert res["tiles_resumed"] >= done - 2  # chunks being renamed at the stop may count
    assert res["tiles_computed"] > 0  # the ranks stopped with work left
    assert out.read_bytes() == ref.read_bytes()
    assert read_raster(out).tobytes() == read_raster(ref).tobytes()


def test_the_input_is_hashed_by_one_rank_for_all(cli_case, tmp_path):
    """Rank 0 hashes the input and gives its fingerprint to the other ranks (each rank
    hashed the whole file before: work done N times)."""
    run, image = cli_case
    hashed = tmp_path / "hashed"
    cmd = [sys.executable, "-m", "helpers.noted_hashes",
           *predict_cmd(run, image, tmp_path / "mask.tif", "tile_size=96", "processes=2")[3:]]
    proc = warm.run(cmd, capture_output=True, text=True,
                    env={**env(), "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
                         "SEG_TEST_HASHED": str(hashed)}, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout[proc.stdout.index("{"):])["processes"] == 2
    assert len(hashed.read_text().split()) == 1
