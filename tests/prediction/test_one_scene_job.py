"""``image=`` and ``images=`` compose one per-scene job: for every prediction option, one
scene predicted either way gives the same exit status and the same bytes (labels,
probabilities, polygons), or the same one-line refusal.

The case that drifted: ``staged=true`` with a U-Net was refused through ``image=`` (exit 2)
but ran unstaged through ``images=`` (exit 0), recording ``staged=True`` in the output's
fingerprint."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pyogrio
import pytest
import zarr
from helpers import warm
from helpers.prediction import env, make_model, make_run, predict_cmd, seg_predict_here

from seg_at_scale.io import example_geotags, write_raster

STEM = "a"
BASE = ("ckpt=last", "tile_size=96", "preview=false", "progress=false")

CASES = {
    "defaults": {},
    "tta": {"tta": "flips"},
    "probabilities": {"probabilities": "uint8"},
    "zarr": {"zarr": True},
    "vector": {"vector": True},
    "staged": {"staged": "true"},
    "fresh": {"resume": "false"},
    "processes": {"processes": 2},
    "zarr_processes": {"zarr": True, "processes": 2, "probabilities": "uint8"},
}


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_job")
    run = make_run(tmp / "run", make_model("same", levels=3, width=8))
    rng = np.random.default_rng(3)
    yy, xx = np.mgrid[0:203, 0:171]
    img = np.stack([np.sin(yy / (5 + b)) * np.cos(xx / (9 + b)) for b in range(4)]) * 90
    img = (img + 128 + rng.normal(0, 25, img.shape)).clip(0, 255).astype(np.uint8)
    (tmp / "scenes").mkdir()
    write_raster(tmp / "scenes" / f"{STEM}.tif", img, tile=(64, 64),
                 geotags=example_geotags(pixel_size=10.0))
    return tmp, run


def _args(case: dict) -> list[str]:
    return [f"{k}={v}" for k, v in case.items() if k not in ("zarr", "vector", "processes")]


def _run(cmd_args: list[str], processes: int, run: Path) -> subprocess.CompletedProcess:
    if processes == 1:
        return seg_predict_here(f"run={run}", *BASE, *cmd_args)
    cmd = predict_cmd(run, Path("unused"), Path("unused"))[:3]  # python -m seg_at_scale.cli.predict
    return warm.run([*cmd, f"run={run}", *BASE, *cmd_args, f"processes={processes}"],
                    capture_output=True, text=True, env=env(), timeout=300)


def _outputs(folder: Path, zarr_out: bool, vector: bool) -> dict[str, object]:
    """What a prediction of the scene wrote into ``folder``, as comparable values."""
    found: dict[str, object] = {}
    if zarr_out:
        store = zarr.open_group(str(folder / f"{STEM}.zarr"), mode="r")
        found["labels"] = np.asarray(store["labels"]).tobytes()
    else:
        found["labels"] = (folder / f"{STEM}.tif").read_bytes()
        probs = folder / f"{STEM}_probabilities.tif"
        if probs.exists():
            found["probabilities"] = probs.read_bytes()
    if vector:
        frame = pyogrio.read_dataframe(folder / f"{STEM}.gpkg")
        found["polygons"] = sorted(zip(frame["class_id"], frame.geometry.to_wkb(), strict=True))
    return found


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_scene_through_image_and_images_gives_the_same_result(scene, name):
    tmp, run = scene
    case = CASES[name]
    zarr_out, vector, processes = bool(case.get("zarr")), bool(case.get("vector")), \
        int(case.get("processes", 1))
    ext = "zarr" if zarr_out else "tif"
    one, many = tmp / name / "one", tmp / name / "many"
    one.mkdir(parents=True)
    single = _run([f"image={tmp / 'scenes' / f'{STEM}.tif'}", f"output={one / f'{STEM}.{ext}'}",
                   *([f"vector={one / f'{STEM}.gpkg'}"] if vector else []), *_args(case)],
                  processes, run)
    archive = _run([f"images={tmp / 'scenes'}", f"output_dir={many}",
                    *([f"output_format={ext}"] if zarr_out else []),
                    *(["vector=gpkg"] if vector else []), *_args(case)], processes, run)
    assert single.returncode == archive.returncode, (single.stderr[-1500:],
                                                      archive.stderr[-1500:])
    if single.returncode != 0:  # the same refusal, in one line, nothing predicted
        last = single.stderr.strip().splitlines()[-1]
        assert last == archive.stderr.strip().splitlines()[-1]
        assert not (many / f"{STEM}.{ext}").exists()
        return
    assert _outputs(one, zarr_out, vector) == _outputs(many, zarr_out, vector)
    for folder in (one, many):  # no working store, no finalising rank's claim, left behind
        assert [p.name for p in folder.iterdir() if p.name.startswith(f".{STEM}.")
                and not p.name.endswith((".lock", ".gpkg.json"))] == []  # (polygons' record)


def test_staged_with_a_network_that_has_no_stages_is_refused_both_ways(scene):
    """The drifted case, spelled out: one line naming the capability, exit 2, either way."""
    tmp, run = scene
    for args in ([f"image={tmp / 'scenes' / f'{STEM}.tif'}", f"output={tmp / 'st' / 'a.tif'}"],
                 [f"images={tmp / 'scenes'}", f"output_dir={tmp / 'st_many'}"]):
        res = seg_predict_here(f"run={run}", *BASE, "staged=true", *args)
        assert res.returncode == 2, res.stderr[-1500:]
        assert res.stderr.strip().splitlines()[-1] == (
            "seg-predict: error: staged=true needs stage-by-stage prediction (stages; smp "
            "networks), which UNet does not have; use staged=false (tiles) or model=smp / its "
            "presets")
