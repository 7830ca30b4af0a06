"""``seg-predict staged=true``: a raster predicted stage by stage into the usual store."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from helpers import warm
from helpers.prediction import make_image
from helpers.smp import preset_model
from test_smp_files import DATA, check_labels

from seg_at_scale.errors import ConfigError, OutputExistsError
from seg_at_scale.io import read_raster
from seg_at_scale.models import UNet
from seg_at_scale.prediction import PredictOptions, predict_raster
from seg_at_scale.prediction.staged_raster import check_staged
from seg_at_scale.tiling import predict_full

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("preset", ["unet_test_resnet", "fpn_test_resnet",
                                    "deeplabv3plus_test_resnet"])
def test_staged_cog_equals_untiled_and_leaves_no_maps(tmp_path, preset):
    """Stage tiles small enough that every stage is several tiles (1 MB each), the scene
    no multiple of 32: the labels equal the untiled forward's, borders included; the
    probabilities are those of its logits; the map files are gone."""
    net = preset_model(preset)
    image = make_image(tmp_path / "scene.tif", height=389, width=461)
    stats = predict_raster(net, image, tmp_path / "pred.tif",
                           PredictOptions(q=2, staged=True, stage_memory_mb=1,
                                          probabilities="uint8", progress=False),
                           normalizer=DATA)
    assert stats.tiles_computed == stats.tiles == 4
    ref = predict_full(net, torch.from_numpy(DATA(read_raster(image)))[None])
    check_labels(read_raster(tmp_path / "pred.tif")[0], ref)
    probs = read_raster(tmp_path / "pred_probabilities.tif")
    expect = torch.round(torch.softmax(ref[0], 0) * 255).numpy()
    assert np.abs(probs.astype(int) - expect).max() <= 1
    assert not any(p.name.endswith(".staged") for p in tmp_path.iterdir())


def test_staged_refusals_before_any_work(tmp_path):
    net = preset_model("unet_test_resnet")
    with pytest.raises(ConfigError, match=r"staged=true runs in one process \(processes=2\)"):
        check_staged(net, PredictOptions(staged=True), world=2)
    with pytest.raises(ConfigError, match=r"staged=true with tta='flips'.*tta=null"):
        check_staged(net, PredictOptions(staged=True, tta="flips"), world=1)
    own = UNet(in_channels=4, num_classes=3, levels=3, base_width=4, padding="same").eval()
    image = make_image(tmp_path / "scene.tif", height=100, width=90)
    with pytest.raises(ConfigError, match=r"staged=true needs stage-by-stage prediction .*"
                                          r"which UNet does not have; use staged=false"):
        predict_raster(own, image, tmp_path / "pred.tif",
                       PredictOptions(staged=True, progress=False), normalizer=DATA)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scene.tif"]


CHILD = [sys.executable, "-m", "helpers.staged_child"]  # IMAGE OUT


def _start_staged_child(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path, Path]:
    """A staged prediction in a child process, returned once its first maps are written."""
    image = make_image(tmp_path / "scene.tif", height=389, width=461)
    out = tmp_path / "pred.tif"
    folder = tmp_path / ".pred.tif.staged"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    proc = warm.popen([*CHILD, str(image), str(out)], env=env)
    deadline = time.monotonic() + 120
    while not (folder.exists() and any(folder.iterdir())):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the run ended before its maps were written")
        time.sleep(0.02)
    return proc, image, out, folder


_WHOLE: dict[bytes, np.ndarray] = {}  # the uninterrupted labels of each scene, by its bytes


def _uninterrupted(tmp_path: Path, image: Path) -> np.ndarray:
    """The labels of an uninterrupted staged run of ``image`` (computed once per scene)."""
    key = hashlib.sha256(image.read_bytes()).digest()
    if key not in _WHOLE:
        net = preset_model("fpn_test_resnet")
        opts = PredictOptions(q=2, staged=True, stage_memory_mb=1, progress=False)
        predict_raster(net, image, tmp_path / "whole.tif", opts, normalizer=DATA)
        _WHOLE[key] = read_raster(tmp_path / "whole.tif")
    return _WHOLE[key]


def _until_stopped(pid: int, timeout: float = 30) -> None:
    """Until the process ``pid`` is stopped (SIGSTOP delivered), not only signalled."""
    end = time.monotonic() + timeout
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < end, f"process {pid} never stopped"
        time.sleep(0.01)


def _signalled(proc: subprocess.Popen, sig: int) -> int:
    """``proc``'s exit status after ``sig`` (killed if it outlives a minute)."""
    try:
        proc.send_signal(sig)
        return proc.wait(60)
    finally:
        proc.kill()


def _rerun_completes(tmp_path: Path, image: Path, out: Path) -> None:
    """The same staged run again writes the labels of an uninterrupted run."""
    net = preset_model("fpn_test_resnet")
    opts = PredictOptions(q=2, staged=True, stage_memory_mb=1, progress=False)
    predict_raster(net, image, out, opts, normalizer=DATA)
    np.testing.assert_array_equal(read_raster(out), _uninterrupted(tmp_path, image))


def test_a_killed_staged_run_leaves_no_output_and_a_rerun_completes_it(tmp_path):
    """SIGKILL while the stages write their maps: no output under the final name, the map
    folder left behind; the rerun removes it and writes the labels of an uninterrupted run."""
    proc, image, out, folder = _start_staged_child(tmp_path)
    assert _signalled(proc, signal.SIGKILL) == -signal.SIGKILL
    assert not out.exists() and folder.exists()
    _rerun_completes(tmp_path, image, out)
    assert not folder.exists()


def test_sigterm_during_the_stages_frees_the_maps_and_a_rerun_completes_it(tmp_path):
    """SIGTERM (a Slurm time limit) while the stages write their maps: seg-predict's handler
    unwinds, so the map folder (at scale, tens of GB) is removed at once, not left to the
    next run; no output under the final name; the rerun writes an uninterrupted run's
    labels."""
    proc, image, out, folder = _start_staged_child(tmp_path)
    assert _signalled(proc, signal.SIGTERM) == 143
    assert not folder.exists() and not out.exists()
    _rerun_completes(tmp_path, image, out)


def test_a_second_staged_run_of_one_output_is_refused_and_leaves_the_first_maps(tmp_path):
    """Two runs of one output at once: the second is refused at the output's lock before it
    touches anything (it would otherwise remove the first run's map folder as stale); the
    first, held stopped meanwhile, then completes with an uninterrupted run's labels."""
    proc, image, out, folder = _start_staged_child(tmp_path)
    try:
        proc.send_signal(signal.SIGSTOP)  # the first run holds its lock, mid-stage
        _until_stopped(proc.pid)  # a signal lands later: the run may free a map meanwhile
        before = {p.name: p.stat().st_ino for p in folder.iterdir()}
        net = preset_model("fpn_test_resnet")
        with pytest.raises(OutputExistsError, match=r"is being written by another run"):
            predict_raster(net, image, out, PredictOptions(q=2, staged=True,
                           stage_memory_mb=1, progress=False), normalizer=DATA)
        assert {p.name: p.stat().st_ino for p in folder.iterdir()} == before
        proc.send_signal(signal.SIGCONT)
        assert proc.wait(120) == 0
    finally:
        proc.kill()
    np.testing.assert_array_equal(read_raster(out), _uninterrupted(tmp_path, image))
    assert not folder.exists()


def test_disk_bytes_is_the_peak_the_map_files_reach(tmp_path, monkeypatch):
    """The space a staged run is checked for, ``StagePlan.disk_bytes``, is exactly the most
    its map files hold at one time (a U-Net keeps its skip maps until its decoder)."""
    import seg_at_scale.prediction.raster as raster
    import seg_at_scale.tiling.staged.stages as staged

    folder = tmp_path / ".pred.tif.staged"
    seen: list[int] = []
    own: list[int] = []
    planned: list[int] = []

    class Recorded(staged.DiskMap):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(sum(p.stat().st_size for p in folder.iterdir()))
            own.append(self.path.stat().st_size)

    def plan_staged(stages, grid, bands, output, options):
        plan = real(stages, grid, bands, output, options)
        planned.append(plan.disk_bytes(stages, grid.extended.height, grid.extended.width))
        return plan

    real = raster.plan_staged
    monkeypatch.setattr(staged, "DiskMap", Recorded)
    monkeypatch.setattr(raster, "plan_staged", plan_staged)
    net = preset_model("unet_test_resnet")
    image = make_image(tmp_path / "scene.tif", height=389, width=461)
    predict_raster(net, image, tmp_path / "pred.tif",
                   PredictOptions(q=2, staged=True, stage_memory_mb=1, progress=False),
                   normalizer=DATA)
    from seg_at_scale.models.smp_stage_split import smp_stages

    assert len(own) == len(smp_stages(net))  # one file per stage
    assert planned == [max(seen)]
    assert max(seen) > max(own)  # the peak holds maps kept for later stages


def test_a_disk_too_small_for_the_maps_is_refused_before_any_work(tmp_path, monkeypatch):
    """Less free space beside the output than the maps' peak: one line naming the folder,
    both sizes and the fixes, nothing written. A killed run's folder of the same output
    counts as free (the run removes it first): the same run then goes ahead."""
    import shutil as sh
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(sh, "disk_usage", lambda path: usage(10**6, 10**6, 1000))
    net = preset_model("unet_test_resnet")
    image = make_image(tmp_path / "scene.tif", height=389, width=461)
    opts = PredictOptions(q=2, staged=True, stage_memory_mb=1, progress=False)
    with pytest.raises(ConfigError, match=r"staged=true: the maps between stages of this 389 "
                       r"x 461 scene need \d+\.\d MiB in '.*\.pred\.tif\.staged' \(beside "
                       r"output='.*pred\.tif'\) at their peak, but 0\.0 MiB is free there; "
                       r"free space .* or use staged=false"):
        predict_raster(net, image, tmp_path / "pred.tif", opts, normalizer=DATA)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scene.tif"]
    stale = tmp_path / ".pred.tif.staged"
    stale.mkdir()
    (stale / "map1.bin").write_bytes(b"\1" * (64 << 20))  # a killed run's, 64 MiB
    predict_raster(net, image, tmp_path / "pred.tif", opts, normalizer=DATA)
    ref = predict_full(net, torch.from_numpy(DATA(read_raster(image)))[None])
    check_labels(read_raster(tmp_path / "pred.tif")[0], ref)
    assert not stale.exists()
    # the same run again on the full disk: the finished output is reported, not refused
    again = predict_raster(net, image, tmp_path / "pred.tif", opts, normalizer=DATA)
    assert again.reused and again.tiles_resumed == again.tiles


def test_a_disk_that_fills_during_the_stages_loses_nothing_and_a_rerun_completes(tmp_path):
    """A real write limit (RLIMIT_FSIZE, below the largest map) makes a map file fail mid-run:
    the error names that file, the map folder is removed, nothing is under the output's
    name; the rerun with room writes an uninterrupted run's labels."""
    from seg_at_scale.models.smp_stage_split import smp_stages
    from seg_at_scale.tiling.staged import plan_stages

    net = preset_model("fpn_test_resnet")
    plan = plan_stages(smp_stages(net), 4, net.downsampling_factor)
    sizes = [c * (400 // s) * (480 // s) * 4 for c, s in zip(plan.channels, plan.strides,
                                                               strict=True)][1:]
    image = make_image(tmp_path / "scene.tif", height=389, width=461)
    out, folder = tmp_path / "pred.tif", tmp_path / ".pred.tif.staged"
    limit = max(sizes) - 1
    proc = warm.run([*CHILD, str(image), str(out)], capture_output=True, text=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent),
                         "PYTHONDONTWRITEBYTECODE": "1"},  # no .pyc cut at the limit
                    limits={"RLIMIT_FSIZE": (limit, limit)}, timeout=300)
    assert proc.returncode == 1
    assert re.search(r"OSError: \[Errno 27\] File too large: '.*\.pred\.tif\.staged/map\d+"
                     r"\.bin'", proc.stderr), proc.stderr[-2000:]
    assert not folder.exists() and not out.exists()
    _rerun_completes(tmp_path, image, out)
