"""seg-predict images=: the faults a review found (errors on one rank, leftovers, limits)."""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import warm
from helpers.prediction import env, make_model, make_run, seg_predict_here

from seg_at_scale.io import example_geotags, write_raster
from seg_at_scale.prediction.checks import store_path

OPTS = ("ckpt=last", "tile_size=96", "preview=false", "stac=false")


def _scene(path: Path, height: int, width: int, seed: int, k: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = np.random.default_rng(seed).integers(0, 255, (4, height, width)).astype(np.uint8)
    return write_raster(path, img, tile=(64, 64), geotags=example_geotags(
        origin=(500000.0 + 3000.0 * k, 4500000.0), pixel_size=10.0))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("review") / "run",
                    make_model("same", levels=3, width=8))


def _cmd(run: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "seg_at_scale.cli.predict", f"run={run}", "progress=false",
            *OPTS, *args]


def _rows(out: Path) -> dict[str, dict]:
    with (out / "summary.csv").open() as f:
        return {r["stem"]: r for r in csv.DictReader(f)}


def _corrupt_first_tile(path: Path) -> None:
    """Overwrite the compressed bytes of the image's first TIFF tile (it fails to decode)."""
    import tifffile

    with tifffile.TiffFile(path) as t:
        off, cnt = t.pages.first.dataoffsets[0], t.pages.first.databytecounts[0]
    data = bytearray(path.read_bytes())
    data[off:off + cnt] = bytes([7]) * cnt
    path.write_bytes(bytes(data))


def test_an_error_raised_on_rank_1_only_is_printed_once(run, tmp_path):
    # one tile per scene, one unit each: 'a' goes to rank 0, the broken 'b' to rank 1 alone
    scenes = tmp_path / "scenes"
    _scene(scenes / "a.tif", 60, 50, 0)
    _scene(scenes / "b.tif", 60, 50, 1, k=1)
    _corrupt_first_tile(scenes / "b.tif")
    res = warm.run(_cmd(run, f"images={scenes}", f"output_dir={tmp_path / 'out'}",
                              "processes=2"),
                   capture_output=True, text=True, env=env(), timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("seg-predict: error:")]
    assert len(errors) == 1, res.stderr[-2000:]
    assert "b.tif" in errors[0]


def _three(tmp_path: Path) -> Path:
    scenes = tmp_path / "scenes"
    for k, (h, w) in enumerate([(203, 171), (97, 131), (64, 60)]):
        _scene(scenes / f"s{k}.tif", h, w, k, k)
    return scenes


def test_a_leftover_store_of_another_prediction_fails_its_scene_on_every_rank(run, tmp_path):
    scenes, out = _three(tmp_path), tmp_path / "out"
    first = seg_predict_here(f"run={run}", *OPTS, f"images={scenes}", f"output_dir={out}",
                             "tile_size=64", "keep_store=true")
    assert first.returncode == 0, first.stderr
    (out / "s1.tif").unlink()  # as if killed before its COG: the tile_size=64 store is left
    for stem in ("s0", "s2"):  # the others start afresh
        (out / f"{stem}.tif").unlink()
        shutil.rmtree(out / f".{stem}.tif.zarr")
    # s1's store is opened by rank 1 (scene 1 of 2 ranks): its refusal must reach rank 0
    skip = warm.run(_cmd(run, f"images={scenes}", f"output_dir={out}", "processes=2",
                               "on_error=skip"),
                    capture_output=True, text=True, env=env(), timeout=300)
    assert skip.returncode == 0, skip.stderr[-2000:]
    rows = _rows(out)
    assert rows["s1"]["status"] == "failed" and not (out / "s1.tif").exists()
    assert "'" + str(out / ".s1.tif.zarr") + "' was made by another prediction" in \
        rows["s1"]["reason"]
    assert rows["s0"]["status"] == rows["s2"]["status"] == "done"
    stop = warm.run(_cmd(run, f"images={scenes}", f"output_dir={out}", "processes=2",
                               "overwrite=false"),
                    capture_output=True, text=True, env=env(), timeout=300)
    errors = [ln for ln in stop.stderr.splitlines() if ln.startswith("seg-predict: error:")]
    assert stop.returncode == 2 and len(errors) == 1, stop.stderr[-2000:]
    assert "s1.tif.zarr' was made by another prediction (differs in: " in errors[0]


def test_a_scene_refused_by_a_config_check_is_listed_or_skipped(run, tmp_path):
    scenes, out = _three(tmp_path), tmp_path / "out"
    (out / "s1.tif").mkdir(parents=True)  # an output that is a folder: a ConfigError
    write_raster(out / "s2.tif", np.zeros((1, 8, 8), np.uint8))  # not ours: refused
    stop = seg_predict_here(f"run={run}", *OPTS, f"images={scenes}", f"output_dir={out}")
    line = stop.stderr.strip().splitlines()
    assert stop.returncode == 2 and len(line) == 1, stop.stderr
    assert "2 of 3 scenes cannot be predicted" in line[0]
    assert f"s1: output '{out / 's1.tif'}' is a folder" in line[0]
    assert f"s2: output '{out / 's2.tif'}' already exists" in line[0]
    skip = seg_predict_here(f"run={run}", *OPTS, f"images={scenes}", f"output_dir={out}",
                            "on_error=skip")
    assert skip.returncode == 0, skip.stderr
    rows = _rows(out)
    assert [rows[s]["status"] for s in ("s0", "s1", "s2")] == ["done", "skipped", "skipped"]
    assert "is a folder" in rows["s1"]["reason"] and (out / "s0.tif").is_file()


def test_an_archive_of_more_scenes_than_open_files_allowed(run, tmp_path):
    scenes, limit = tmp_path / "scenes", 20
    for k in range(30):  # each scene's input was held open from planning to the end
        _scene(scenes / f"s{k:02d}.tif", 24, 24, k, k)
    res = warm.run(_cmd(run, f"images={scenes}", f"output_dir={tmp_path / 'out'}"),
                   capture_output=True, text=True, env=env(), timeout=300,
                   limits={"RLIMIT_NOFILE": (limit, limit)})
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout[res.stdout.index("{"):])["done"] == 30


def test_killed_between_the_probabilities_and_the_labels_resumes(run, tmp_path):
    import zarr

    image = _scene(tmp_path / "s.tif", 97, 131, 0)
    args = (f"run={run}", *OPTS, f"image={image}", "probabilities=uint8")
    ref = seg_predict_here(*args, f"output={tmp_path / 'ref' / 's.tif'}")
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "out" / "s.tif"
    first = seg_predict_here(*args, f"output={out}", "keep_store=true")
    assert first.returncode == 0, first.stderr
    out.unlink()  # the state a finaliser killed after the probabilities COG leaves
    zarr.open_group(tmp_path / "out" / ".s.tif.zarr", mode="r+").attrs["complete"] = False
    again = seg_predict_here(*args, f"output={out}")
    assert again.returncode == 0, again.stderr
    res = json.loads(again.stdout[again.stdout.index("{"):])
    assert (res["tiles_computed"], res["tiles_resumed"]) == (0, res["tiles"])
    assert out.read_bytes() == (tmp_path / "ref" / "s.tif").read_bytes()
    probs = "s_probabilities.tif"
    assert (out.parent / probs).read_bytes() == (tmp_path / "ref" / probs).read_bytes()


def test_a_nodata_nan_store_resumes(run, tmp_path):
    import zarr

    img = np.random.default_rng(0).uniform(0, 255, (4, 100, 90)).astype(np.float32)
    img[:, :10, :10] = np.nan
    image = write_raster(tmp_path / "f.tif", img, tile=(64, 64), geotags=example_geotags(
        origin=(500000.0, 4500000.0), pixel_size=10.0))
    out = tmp_path / "f.zarr"
    args = (f"run={run}", *OPTS, f"image={image}", f"output={out}", "nodata=nan",
            "check_dtype=false")
    first = seg_predict_here(*args)
    assert first.returncode == 0, first.stderr
    labels = zarr.open_group(out, mode="r")["labels"][:]
    working = out.rename(store_path(out))  # as if killed before one tile was written
    zarr.open_group(working, mode="r+").attrs["complete"] = False
    next(p for p in (working / "labels" / "c").rglob("*") if p.is_file()).unlink()
    again = seg_predict_here(*args)
    assert again.returncode == 0, again.stderr
    res = json.loads(again.stdout[again.stdout.index("{"):])
    assert (res["tiles_computed"], res["tiles_resumed"]) == (1, res["tiles"] - 1)
    np.testing.assert_array_equal(zarr.open_group(out, mode="r")["labels"][:], labels)


def test_a_reused_output_rewrites_its_item_and_polygons_made_with_other_options(run, tmp_path):
    import geopandas as gpd

    image, out = _scene(tmp_path / "s.tif", 203, 171, 0), tmp_path / "out"
    base = (f"run={run}", "ckpt=last", "tile_size=96", "preview=false", f"image={image}",
            f"output={out / 's.tif'}")
    vector = f"vector={out / 's.gpkg'}"
    for args in ((), (vector,), (vector, "vector_min_area=1e9"), (vector,)):
        res = seg_predict_here(*base, *args)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout[res.stdout.index("{"):])["tiles_computed"] == (
            0 if args else 20)
        assets = json.loads((out / "s.stac.json").read_text())["assets"]
        assert ("vectors" in assets) == bool(args)
        if args:  # the Item describes the polygons there now
            sha = hashlib.sha256((out / "s.gpkg").read_bytes()).hexdigest()
            assert assets["vectors"]["file:checksum"] == "1220" + sha
            polygons = len(gpd.read_file(out / "s.gpkg"))
            assert (polygons == 0) == ("vector_min_area=1e9" in args), polygons


def test_a_scene_left_with_missing_tiles_is_a_failure(run, tmp_path, monkeypatch):
    from seg_at_scale.prediction import archive

    real = archive.predict_scenes

    def drops_one_of_s1(model, works, *args, **kwargs):  # a tile less
        for w in works:
            if w.store.path.name == ".s1.tif.zarr":
                w.batches = w.batches[1:]
        return real(model, works, *args, **kwargs)

    monkeypatch.setattr(archive, "predict_scenes", drops_one_of_s1)
    scenes, out = _three(tmp_path), tmp_path / "out"
    stop = seg_predict_here(f"run={run}", *OPTS, f"images={scenes}", f"output_dir={out}")
    assert stop.returncode == 2, stop.stderr
    assert stop.stderr.strip() == (
        f"seg-predict: error: 1 of 4 tiles of '{out / 's1.tif'}' are missing from its store "
        f"'{out / '.s1.tif.zarr'}' after every rank finished; rerun the same command to "
        "compute them")
    skip = seg_predict_here(f"run={run}", *OPTS, f"images={scenes}", f"output_dir={out}",
                            "on_error=skip")
    assert skip.returncode == 0, skip.stderr
    res = json.loads(skip.stdout[skip.stdout.index("{"):])
    assert (res["failed"], res["reused"]) == (1, 2) and "1 of 4 tiles" in res["problems"]["s1"]
    assert _rows(out)["s1"]["status"] == "failed" and not (out / "s1.tif").exists()


def test_an_option_every_scene_refuses_is_one_error_not_a_list(run, tmp_path):
    scenes, out = _three(tmp_path), tmp_path / "out"
    for mode in ("stop", "skip"):
        res = seg_predict_here(f"run={run}", *OPTS, f"images={scenes}", f"output_dir={out}",
                               "vector=gpkg", "vector_classes=[-1]", f"on_error={mode}")
        line = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(line) == 1, res.stderr
        assert "classes=[-1] holds [-1]" in line[0] and "scenes cannot be predicted" not in line[0]
        assert not (out / "summary.csv").exists()


def test_a_second_archive_into_the_same_output_dir_names_the_folder(run, tmp_path):
    """Another run holding the archive's lock: the refusal names output_dir (was: the
    lock's stand-in 'out/archive', a path that does not exist)."""
    from seg_at_scale.prediction.lock import output_lock

    scenes, out = _three(tmp_path), tmp_path / "out"
    with output_lock(out / "archive"):  # what the first run holds while it predicts
        second = seg_predict_here(f"run={run}", *OPTS, f"images={scenes}", f"output_dir={out}")
    assert second.returncode == 2
    assert f"output_dir '{out}' is being written by another run" in second.stderr
    assert not list(out.glob("*.tif"))  # nothing predicted
