"""``seg-predict``'s start and its ranks' ends (#39), with real processes.

* The output lock is the command's first work: taken before torch is imported and the model
  loaded, so of two commands writing one output the first started wins, and the other is
  refused in a fraction of a second (it was refused or won by who finished importing first).
* A forked rank killed by a signal ends the run at once with one line naming the rank, the
  signal and how to resume (was: exit 137 up to 30 s later with only torch's "Terminating
  process" line); the same command then completes it with the one-process bytes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import warm
from helpers.prediction import chunks_written, env, make_image, make_model, make_run, predict_cmd

from seg_at_scale.io import read_raster
from seg_at_scale.prediction.lock import lock_path, output_lock

# ``seg-predict`` in a fresh interpreter that reports, whenever a lock file is acquired,
# whether torch or Lightning were imported by then (the forked ranks run from ``-c`` too)
_SPY = """
import sys, filelock
acquire = filelock.FileLock.acquire
def spy(self, *args, **kwargs):
    loaded = sorted(m for m in ("torch", "lightning_fabric") if m in sys.modules)
    print(f"lock {self.lock_file} imported={loaded}", flush=True)
    return acquire(self, *args, **kwargs)
filelock.FileLock.acquire = spy
from seg_at_scale.cli.predict import main
sys.argv = ["seg-predict", *sys.argv[1:]]
main()
"""


def _spied(cmd: list[str]) -> list[str]:
    return [sys.executable, "-c", _SPY, *cmd[3:]]  # predict_cmd's arguments after -m <module>


def _locked(stdout: str, lock: Path) -> str:
    """What the spy printed when ``lock`` was first acquired."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(f"lock {lock} ")]
    assert lines, stdout[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def small_case(tmp_path_factory):
    """A run folder and a scene small enough to predict in a few seconds on a busy machine,
    with the one-process COG of it (``tile_size=64``)."""
    tmp = tmp_path_factory.mktemp("start")
    run = make_run(tmp / "run", make_model("same", levels=3, width=8))
    image = make_image(tmp / "scene.tif", height=200, width=300)
    ref = tmp / "one" / "mask.tif"
    out = warm.run(predict_cmd(run, image, ref, "tile_size=64"), capture_output=True,
                   text=True, env=env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return run, image, ref


@pytest.mark.parametrize("other", ["mask.tif", "mask.zarr"])
def test_the_first_command_holds_the_lock_before_torch_and_the_second_is_refused(small_case,
                                                                                  tmp_path,
                                                                                  other):
    """``mask.zarr`` shares ``mask.tif``'s companions (preview, STAC Item): before, the two
    ran at once, and the later replaced the other's preview and failed after its tiles."""
    run, image, ref = small_case
    out = tmp_path / "busy" / "mask.tif"
    lock = lock_path(out)
    assert lock == lock_path(out.with_name(other))
    first = warm.popen(_spied(predict_cmd(run, image, out, "tile_size=64")), env=env(),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not lock.exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        assert lock.exists(), "the first command never took the output lock"
        t0 = time.perf_counter()
        second = warm.run(_spied(predict_cmd(run, image, out.with_name(other),
                                             "tile_size=64")), env=env(),
                          capture_output=True, text=True, timeout=60)
        refused_s = time.perf_counter() - t0
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 2, second.stderr[-3000:]
    assert second.stderr.strip().splitlines() == [
        f"seg-predict: error: output '{out.with_name(other)}' is being written by another "
        f"run (its lock "
        f"'{lock}' is held); wait for it to finish or choose another output"]
    # both took (or tried) the lock before torch and Lightning were imported
    assert _locked(second.stdout, lock).endswith("imported=[]"), second.stdout
    assert first.returncode == 0, stderr[-3000:]
    assert _locked(stdout, lock).endswith("imported=[]"), stdout[:2000]
    assert read_raster(out).tobytes() == read_raster(ref).tobytes()
    assert not lock.exists()
    print(f"refused in {refused_s:.2f} s")


def test_an_archive_takes_its_own_lock_before_torch(small_case, tmp_path):
    run, image, _ = small_case
    scenes, out = tmp_path / "scenes", tmp_path / "out"
    scenes.mkdir()
    (scenes / "a.tif").write_bytes(image.read_bytes())
    cmd = [*predict_cmd(run, image, out, "tile_size=64")[:4], "progress=false",
           f"images={scenes}", f"output_dir={out}"]
    with output_lock(out / "archive") as lock:  # another archive writing the same output_dir
        t0 = time.perf_counter()
        res = warm.run(_spied(cmd), env=env(), capture_output=True, text=True,
                       timeout=60)
        refused_s = time.perf_counter() - t0
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines() == [
        f"seg-predict: error: output_dir '{out}' is being written by another run (its lock "
        f"'{lock}' is held); wait for it to finish or choose another output"]
    assert _locked(res.stdout, lock).endswith("imported=[]"), res.stdout
    assert sorted(p.name for p in out.iterdir()) == []  # nothing else written
    print(f"refused in {refused_s:.2f} s")


def test_a_killed_rank_ends_the_run_at_once_naming_it_and_the_rerun_completes(small_case,
                                                                              tmp_path):
    """Rank 1 SIGKILLed (the OOM killer) while rank 0 cannot take the SIGTERM that torch's
    launcher then sends it (stopped here: a rank inside a long C call or a collective
    waits as long): the launcher still ends within seconds (torch waited 30 s), with one
    line naming the rank, its signal and the resume; the same command completes the
    prediction with the one-process bytes."""
    run, image, ref = small_case
    for attempt in range(3):  # a loaded machine can let the ranks finish before the watch
        out = tmp_path / f"killed{attempt}" / "mask.tif"  # stops them: the scene again
        store = out.with_name(".mask.tif.zarr")
        cmd = predict_cmd(run, image, out, "tile_size=64", "processes=2")
        proc, stderr, ranks = _kill_rank_1_mid_run(cmd, store)
        if chunks_written(store) < 247:
            break
    victim = ranks[1]
    assert proc.returncode == 128 + signal.SIGKILL, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        f"seg-predict: error: rank 1 of 2 (pid {victim.pid}) was killed by SIGKILL (what the "
        "out-of-memory killer sends: fewer processes or a smaller tile_size need less memory), "
        "and the other ranks were stopped; run the same command again to resume: the "
        "completed tiles are kept")
    assert "Terminating process" not in stderr
    psutil.wait_procs(ranks, timeout=20)
    assert not out.exists() and not lock_path(out).exists()
    done = chunks_written(store)
    again = warm.run(cmd, capture_output=True, text=True, env=env(), timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    res = json.loads(again.stdout[again.stdout.index("{"):])
    assert res["tiles_resumed"] >= done - 2 and res["tiles_computed"] > 0
    assert out.read_bytes() == ref.read_bytes()
    assert read_raster(out).tobytes() == read_raster(ref).tobytes()


def _kill_rank_1_mid_run(cmd: list[str], store: Path) -> tuple[subprocess.Popen, str,
                                                                list[psutil.Process]]:
    """Start ``cmd`` (two ranks); once 2 chunks are written, stop rank 0 and SIGKILL rank 1.

    The ranks compute all 247 tiles in ~0.4 s: they are found before their first chunk
    and yield the CPU to this watch, so that the signals land mid-run.
    """
    proc = warm.popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True)
    launcher = psutil.Process(proc.pid)
    launcher.nice(10)
    ranks: list[psutil.Process] = []
    try:
        deadline = time.time() + 120
        while (len(launcher.children()) < 2 and time.time() < deadline
               and proc.poll() is None and chunks_written(store) == 0):
            time.sleep(0.01)
        ranks = sorted(launcher.children(), key=lambda p: p.pid)
        assert len(ranks) == 2, proc.communicate()[1][-3000:]
        for rank in ranks:
            rank.nice(10)
        survivor, victim = ranks  # forked in rank order: rank 0, rank 1
        while chunks_written(store) < 2 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.002)
        survivor.send_signal(signal.SIGSTOP)
        victim.send_signal(signal.SIGKILL)
        _, stderr = proc.communicate(timeout=25)  # torch alone: > 30 s
    finally:
        for rank in ranks:  # what the old code left stopped
            if rank.is_running():
                rank.kill()
        if proc.poll() is None:
            proc.kill()
    return proc, stderr, ranks
