"""Reruns over finished outputs (issue #39): a user's file at a companion's path is never
replaced without overwrite=true; a one-scene run and an archive never write one scene at
once; an image replaced by other pixels (same size, mtime set back) is never reused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import geopandas as gpd
import numpy as np
import pytest
import shapely
from helpers import warm
from helpers.prediction import (
    NORM,
    chunks_written,
    env,
    make_image,
    make_model,
    make_run,
    predict_cmd,
    seg_predict_here,
)

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.errors import OutputExistsError
from seg_at_scale.io import example_geotags, read_raster, write_raster
from seg_at_scale.prediction.checks import store_path
from seg_at_scale.prediction.options import PredictOptions
from seg_at_scale.prediction.raster import predict_raster

OPTS = ("ckpt=last", "tile_size=96")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("rerun") / "run",
                    make_model("same", levels=3, width=8))


def _ok(res: subprocess.CompletedProcess) -> dict:
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout[res.stdout.index("{"):])


def _refused(res: subprocess.CompletedProcess, *parts: str) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def _users_gpkg(path: Path) -> bytes:
    gpd.GeoDataFrame({"name": ["my field"]}, geometry=[shapely.box(0, 0, 1, 1)],
                     crs="EPSG:32633").to_file(path)
    return path.read_bytes()


# -- 1. companions a rerun would write over -----------------------------------------------

def test_a_rerun_refuses_a_users_file_at_each_companions_path(run, tmp_path):
    """Before: the output finished, the check returned early and the polygons, the STAC
    Item and the preview were written over the user's files (1 -> N features), exit 0."""
    image = make_image(tmp_path / "scene.tif", 131, 97)
    out = tmp_path / "o" / "a.tif"
    args = (f"run={run}", f"image={image}", f"output={out}", *OPTS)
    _ok(seg_predict_here(*args))  # the labels, a preview and a STAC Item
    mine = _users_gpkg(tmp_path / "o" / "mine.gpkg")
    res = seg_predict_here(*args, f"vector={tmp_path / 'o' / 'mine.gpkg'}")
    _refused(res, f"vector '{tmp_path / 'o' / 'mine.gpkg'}' already exists",
             "not written by the prediction", "overwrite=true")
    assert (tmp_path / "o" / "mine.gpkg").read_bytes() == mine

    for name, body in (("a.stac.json", b'{"my": "catalog"}\n'),
                       ("a_preview.png", b"my picture")):
        ours = (out.parent / name).read_bytes()
        (out.parent / name).write_bytes(body)  # a user's file where the prediction wrote its own
        key = "stac" if name.endswith(".json") else "preview"
        _refused(seg_predict_here(*args), f"{key} '{out.parent / name}' already exists",
                 "overwrite=true")
        assert (out.parent / name).read_bytes() == body
        (out.parent / name).write_bytes(ours)  # the prediction's own again: kept, exit 0
        assert _ok(seg_predict_here(*args))["tiles_computed"] == 0
        assert (out.parent / name).read_bytes() == ours

    item = json.loads((out.parent / "a.stac.json").read_text())
    item["properties"]["title"] = "edited by hand"  # the prediction's Item, changed since
    (out.parent / "a.stac.json").write_text(json.dumps(item))
    _refused(seg_predict_here(*args, f"vector={out.with_name('a.gpkg')}"),
             f"stac '{out.parent / 'a.stac.json'}' already exists")
    assert not out.with_name("a.gpkg").exists()  # refused before anything was written

    done = _ok(seg_predict_here(*args, f"vector={tmp_path / 'o' / 'mine.gpkg'}",
                                "overwrite=true"))
    assert done["tiles_computed"] > 0 and len(gpd.read_file(tmp_path / "o" / "mine.gpkg")) > 1
    again = _ok(seg_predict_here(*args, f"vector={tmp_path / 'o' / 'mine.gpkg'}"))
    assert again["tiles_computed"] == 0  # now the prediction's own: a rerun keeps them


def test_a_tif_and_a_zarr_of_one_name_never_take_each_others_companions(run, tmp_path):
    """``a.tif`` and ``a.zarr`` share their companions' names and, for one prediction, its
    digest. Before: after ``a.zarr overwrite=true`` replaced them, a rerun of ``a.tif``
    reported ``a.stac.json`` as its Item, which described ``./a.zarr``."""
    image = make_image(tmp_path / "scene.tif", 131, 97)
    tif, zarr = tmp_path / "o" / "a.tif", tmp_path / "o" / "a.zarr"
    _ok(seg_predict_here(f"run={run}", f"image={image}", f"output={tif}", *OPTS))
    item = tmp_path / "o" / "a.stac.json"
    _refused(seg_predict_here(f"run={run}", f"image={image}", f"output={zarr}", *OPTS),
             f"'{tmp_path / 'o' / 'a_preview.png'}' already exists", "overwrite=true")
    _ok(seg_predict_here(f"run={run}", f"image={image}", f"output={zarr}", *OPTS,
                         "overwrite=true"))
    zarrs = item.read_bytes(), (tmp_path / "o" / "a_preview.png").read_bytes()
    assert json.loads(zarrs[0])["assets"]["labels"]["href"] == "./a.zarr"
    _refused(seg_predict_here(f"run={run}", f"image={image}", f"output={tif}", *OPTS),
             f"'{tmp_path / 'o' / 'a_preview.png'}' already exists and was not written by "
             f"the prediction of '{tif}'", "overwrite=true")
    assert (item.read_bytes(), (tmp_path / "o" / "a_preview.png").read_bytes()) == zarrs
    again = _ok(seg_predict_here(f"run={run}", f"image={image}", f"output={tif}", *OPTS,
                                 "overwrite=true"))
    assert again["stac"] == str(item)
    assert json.loads(item.read_text())["assets"]["labels"]["href"] == "./a.tif"


def test_overwrite_starts_afresh_over_a_killed_runs_store_of_another_prediction(run,
                                                                                 tmp_path):
    """The README promises ``overwrite=true`` predicts it again. Before: refused, naming
    only ``resume=false``."""
    image = make_image(tmp_path / "scene.tif", 131, 97)
    out = tmp_path / "o" / "a.tif"
    args = (f"run={run}", f"image={image}", f"output={out}", "ckpt=last")
    _ok(seg_predict_here(*args, "tile_size=64", "keep_store=true", "preview=false",
                         "stac=false"))
    out.unlink()  # as a run killed before its COG leaves it: the tile_size=64 store
    assert store_path(out).is_dir()
    _refused(seg_predict_here(*args, "tile_size=96"), "was made by another prediction",
             "rerun with resume=false or overwrite=true to start afresh")
    done = _ok(seg_predict_here(*args, "tile_size=96", "overwrite=true"))
    assert done["tiles_resumed"] == 0 and done["tiles_computed"] == done["tiles"]
    fresh = tmp_path / "o" / "fresh.tif"
    _ok(seg_predict_here(f"run={run}", f"image={image}", f"output={fresh}", "ckpt=last",
                         "tile_size=96"))
    np.testing.assert_array_equal(read_raster(out), read_raster(fresh))
    assert not store_path(out).exists()


def test_an_archive_rerun_refuses_a_users_file_at_a_scenes_companion(run, tmp_path):
    scenes, out = tmp_path / "scenes", tmp_path / "out"
    scenes.mkdir()
    for k, stem in enumerate(("a", "b")):
        make_image(scenes / f"{stem}.tif", 70 + 9 * k, 60, seed=k)
    args = (f"run={run}", *OPTS, f"images={scenes}", f"output_dir={out}", "vector=gpkg")
    assert _ok(seg_predict_here(*args))["done"] == 2
    mine = b'{"type": "Feature", "id": "mine"}\n'
    (out / "b.stac.json").write_bytes(mine)
    gpkg = _users_gpkg(out / "a.gpkg")
    _refused(seg_predict_here(*args), "2 of 2 scenes cannot be predicted",
             f"vector '{out / 'a.gpkg'}' already exists",
             f"stac '{out / 'b.stac.json'}' already exists")
    skip = _ok(seg_predict_here(*args, "on_error=skip"))
    assert (skip["skipped"], skip["reused"]) == (2, 0)
    assert (out / "b.stac.json").read_bytes() == mine and (out / "a.gpkg").read_bytes() == gpkg


# -- 2. one writer per scene, archive or not ----------------------------------------------

def _archive_cmd(run: Path, scenes: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "seg_at_scale.cli.predict", f"run={run}", "progress=false",
            "ckpt=last", "tile_size=96", "preview=false", "stac=false", f"images={scenes}",
            f"output_dir={out}"]


def _stopped_mid_scene(cmd: list[str], store: Path) -> subprocess.Popen:
    proc = warm.popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True)
    while chunks_written(store) < 1 and proc.poll() is None:
        time.sleep(0.01)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    os.kill(proc.pid, signal.SIGSTOP)  # held mid-scene, its lock held
    return proc


def _resumed(proc: subprocess.Popen) -> dict:
    os.kill(proc.pid, signal.SIGCONT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout[stdout.index("{"):])


@pytest.mark.parametrize("first", ["archive", "single"])
def test_an_archive_and_a_one_scene_run_never_write_one_scene_at_once(run, tmp_path, first):
    """Before: the archive held only its folder's lock; the one-scene run wrote the same
    store meanwhile (and reported tiles missing), or the archive wrote the one-scene run's."""
    scenes, out = tmp_path / "scenes", tmp_path / "out"
    scenes.mkdir()
    image = make_image(scenes / "s.tif")  # 517 x 743: 150 tiles of 96
    output = out / "s.tif"
    single = predict_cmd(run, image, output, "ckpt=last", "tile_size=96", "preview=false",
                         "stac=false")
    archive = _archive_cmd(run, scenes, out)
    proc = _stopped_mid_scene(archive if first == "archive" else single, out / ".s.tif.zarr")
    try:
        second = warm.run(single if first == "archive" else archive,
                          capture_output=True, text=True, env=env(), timeout=300)
        held = out / (".archive.scenes.lock" if first == "archive" else ".s.output.lock")
        by = "an archive" if first == "archive" else "another run"
        _refused(second, f"output '{output}' is being written by {by} (its lock '{held}' is "
                 "held); wait for it to finish")
    finally:
        res = _resumed(proc)
    assert res["tiles_computed"] > 0 and read_raster(output).shape == (1, 517, 743)
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no lock left


# -- 3. the input known by its content ----------------------------------------------------

def _same_size_image(path: Path, seed: int) -> Path:
    """Smooth fields + noise, uncompressed: every seed gives a file of the same size."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:150, 0:190] + rng.integers(0, 100, (2, 1, 1))
    img = np.stack([np.sin(yy / (17 + 5 * b)) * np.cos(xx / (23 + 3 * b)) for b in range(4)])
    img = (img * 90 + 128 + rng.normal(0, 20, img.shape)).clip(0, 255).astype(np.uint8)
    return write_raster(path, img, tile=(64, 64), compression=None, overwrite=True,
                        geotags=example_geotags(origin=(500000.0, 4500000.0), pixel_size=10.0))


def _replace_keeping_mtime(image: Path, seed: int) -> None:
    before = image.stat()
    _same_size_image(image, seed)
    os.utime(image, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = image.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


@pytest.fixture(scope="module")
def net():
    return make_model("same", levels=3, width=8)


def _predict(net, image: Path, out: Path, **options) -> np.ndarray:
    predict_raster(net, image, out, PredictOptions(tile_size=64, progress=False, **options),
                   normalizer=Normalizer(NORM["scale"], NORM["mean"], NORM["std"]))
    if out.suffix == ".zarr":
        import zarr

        return zarr.open_group(out, mode="r")["labels"][:]
    return read_raster(out)


def test_a_finished_output_of_replaced_pixels_is_not_reused(net, tmp_path):
    """Before: same path, size and mtime, so the old image's labels were 'reused'."""
    image, out = _same_size_image(tmp_path / "scene.tif", 1), tmp_path / "a.tif"
    old = _predict(net, image, out)
    _replace_keeping_mtime(image, 2)
    fresh = _predict(net, image, tmp_path / "fresh.tif")
    assert (fresh != old).mean() > 0.05  # other labels: a stale reuse shows
    with pytest.raises(OutputExistsError, match="was made by another prediction"):
        _predict(net, image, out)  # the same command: not the old labels
    np.testing.assert_array_equal(_predict(net, image, out, overwrite=True), fresh)


def _as_killed_mid_way(out: Path) -> int:
    """Make a finished ``.zarr`` what a run killed after a third of its tiles leaves.

    Its working store, under the hidden name, without those tiles; returns the tiles kept.
    """
    import zarr

    working = store_path(out)
    out.rename(working)
    zarr.open_group(working, mode="r+").attrs["complete"] = False
    chunks = sorted(p for p in (working / "labels" / "c").rglob("*") if p.is_file())
    for p in chunks[: len(chunks) // 3]:
        p.unlink()
    return len(chunks) - len(chunks) // 3


def test_a_store_of_replaced_pixels_is_not_resumed(net, tmp_path):
    """Before: a killed run's store resumed, the old image's tiles kept (mixed labels)."""
    image, out = _same_size_image(tmp_path / "scene.tif", 1), tmp_path / "a.zarr"
    _predict(net, image, out)
    _as_killed_mid_way(out)
    _replace_keeping_mtime(image, 2)
    fresh = _predict(net, image, tmp_path / "fresh.zarr")
    with pytest.raises(OutputExistsError, match=r"differs in: input"):
        _predict(net, image, out)
    np.testing.assert_array_equal(_predict(net, image, out, resume=False), fresh)


def test_an_archive_rerun_over_a_replaced_scene_does_not_reuse_it(run, tmp_path):
    scenes, out = tmp_path / "scenes", tmp_path / "out"
    scenes.mkdir()
    image = _same_size_image(scenes / "s.tif", 1)
    args = (f"run={run}", *OPTS, "preview=false", "stac=false", f"images={scenes}",
            f"output_dir={out}")
    _ok(seg_predict_here(*args))
    _replace_keeping_mtime(image, 2)
    _refused(seg_predict_here(*args), f"output '{out / 's.tif'}' was made by another prediction")
    assert _ok(seg_predict_here(*args, "overwrite=true"))["done"] == 1
    alone = tmp_path / "alone.tif"
    _ok(seg_predict_here(f"run={run}", f"image={image}", f"output={alone}", *OPTS,
                         "preview=false", "stac=false"))
    assert (out / "s.tif").read_bytes() == alone.read_bytes()


# -- 4. the input's hash: BLAKE3, outputs named by SHA-256 before still recognised ----------

def test_the_input_is_named_by_the_blake3_of_its_bytes_read_in_chunks(net, tmp_path):
    """The fingerprint's ``input`` is BLAKE3 of the whole file; a file of several read
    chunks (not a multiple of one) hashes as its bytes do in one piece."""
    import blake3

    from seg_at_scale.prediction import provenance

    big = tmp_path / "big.bin"
    big.write_bytes(np.random.default_rng(3).bytes(2 * provenance._BLAKE3_CHUNK + 4099))
    want = "blake3:" + blake3.blake3(big.read_bytes()).hexdigest()
    assert provenance.file_blake3(big) == want
    # a child forked after a hash on every core hashes too (BLAKE3's global pool hung there)
    reply = _in_forked_child(lambda: provenance.file_blake3(big))
    assert reply == want
    image, out = _same_size_image(tmp_path / "scene.tif", 1), tmp_path / "a.zarr"
    _predict(net, image, out)
    import zarr

    fingerprint = zarr.open_group(out, mode="r").attrs["fingerprint"]
    assert fingerprint["input"] == "blake3:" + blake3.blake3(image.read_bytes()).hexdigest()


def _in_forked_child(fn, timeout: float = 20.0) -> str:
    """``fn()``'s string from a forked child, or the reason there is none."""
    import os
    import select

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer, then end without the parent's teardown
        os.close(read)
        try:
            os.write(write, fn().encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        if not select.select([read], [], [], timeout)[0]:
            os.kill(pid, 9)
            return f"no answer in {timeout} s"
        return os.read(read, 4096).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)


def _as_before_blake3(monkeypatch: pytest.MonkeyPatch) -> None:
    """Predict as builds before BLAKE3 did: the input named by the SHA-256 of its bytes."""
    from seg_at_scale.prediction import plan, provenance

    monkeypatch.setattr(plan, "input_id", provenance.file_sha256)


def test_an_output_finished_when_sha256_named_inputs_is_still_recognised(
        net, tmp_path, monkeypatch):
    """Rerunning the command over an output an earlier build finished keeps it (no tile
    computed, the same bytes) instead of refusing it as another prediction's; the same
    output over replaced pixels is still refused."""
    image, out = _same_size_image(tmp_path / "scene.tif", 1), tmp_path / "a.tif"
    with monkeypatch.context() as m:
        _as_before_blake3(m)
        _predict(net, image, out)
    before = out.read_bytes()
    stats = predict_raster(net, image, out, PredictOptions(tile_size=64, progress=False),
                           normalizer=Normalizer(NORM["scale"], NORM["mean"], NORM["std"]))
    assert stats.reused and stats.tiles_computed == 0 and out.read_bytes() == before
    _replace_keeping_mtime(image, 2)
    with pytest.raises(OutputExistsError, match="was made by another prediction"):
        _predict(net, image, out)


def test_a_store_begun_when_sha256_named_inputs_resumes_to_the_same_labels(
        net, tmp_path, monkeypatch):
    """A store an earlier build left (killed mid-way) resumes: its finished tiles are kept
    and the labels equal a fresh prediction's; over replaced pixels it is refused."""
    import zarr

    image = _same_size_image(tmp_path / "scene.tif", 1)
    fresh = _predict(net, image, tmp_path / "fresh.zarr")

    def killed_store(out: Path) -> int:
        with monkeypatch.context() as m:
            _as_before_blake3(m)
            _predict(net, image, out)
        assert zarr.open_group(out, mode="r").attrs["fingerprint"]["input"].startswith(
            "sha256:")
        return _as_killed_mid_way(out)

    out = tmp_path / "a.zarr"
    kept = killed_store(out)
    stats = predict_raster(net, image, out, PredictOptions(tile_size=64, progress=False),
                           normalizer=Normalizer(NORM["scale"], NORM["mean"], NORM["std"]))
    assert stats.tiles_resumed == kept > 0 and stats.tiles_computed > 0
    np.testing.assert_array_equal(zarr.open_group(out, mode="r")["labels"][:], fresh)
    other = tmp_path / "b.zarr"
    killed_store(other)
    _replace_keeping_mtime(image, 2)
    with pytest.raises(OutputExistsError, match=r"differs in: input"):
        _predict(net, image, other)


def test_overwrite_takes_the_replaced_predictions_companions_with_it(run, tmp_path):
    """Before: ``overwrite=true`` with other inputs and options left the replaced
    prediction's probabilities and polygons beside the new labels, and the next run that
    asked for polygons at that path was refused as "not written by the prediction"."""
    a = make_image(tmp_path / "a.tif", height=131, width=149, seed=1)
    b = make_image(tmp_path / "b.tif", height=131, width=149, seed=2)
    out, polygons = tmp_path / "o" / "m.tif", tmp_path / "o" / "m.gpkg"
    _ok(seg_predict_here(f"run={run}", f"image={a}", f"output={out}", *OPTS,
                         "probabilities=uint8", f"vector={polygons}"))
    old_png = (tmp_path / "o" / "m_preview.png").read_bytes()
    _ok(seg_predict_here(f"run={run}", f"image={b}", f"output={out}", *OPTS,
                         "overwrite=true"))
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "m.stac.json", "m.tif", "m_preview.png"]
    assert (tmp_path / "o" / "m_preview.png").read_bytes() != old_png  # drawn again
    item = json.loads((tmp_path / "o" / "m.stac.json").read_text())
    assert sorted(item["assets"]) == ["labels"]
    _ok(seg_predict_here(f"run={run}", f"image={b}", f"output={out}", *OPTS,
                         f"vector={polygons}"))  # the polygons of the labels now there
    assert polygons.exists()
    (tmp_path / "o" / "m_preview.png").write_bytes(b"the user's own picture")
    _ok(seg_predict_here(f"run={run}", f"image={a}", f"output={out}", *OPTS,
                         "overwrite=true", "preview=false", "stac=false"))
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.tif", "m_preview.png"]
    assert (tmp_path / "o" / "m_preview.png").read_bytes() == b"the user's own picture"


@pytest.mark.parametrize("archive", [False, True])
def test_a_working_store_a_killed_run_left_beside_its_finished_output_is_removed(
        run, tmp_path, archive):
    """Before: a SIGKILL after the COG was renamed into place, before or while its working
    store ``.NAME.tif.zarr`` was deleted, left the store (the labels' size, hidden) for
    good: the rerun reused the output and never looked at it, and a half-deleted store
    then refused ``overwrite=true`` as "not a seg_at_scale prediction store"."""
    (tmp_path / "scenes").mkdir()
    image = make_image(tmp_path / "scenes" / "s.tif", 211, 173)
    out = tmp_path / "out" / "s.tif"
    args = ((f"images={tmp_path / 'scenes'}", f"output_dir={out.parent}") if archive
            else (f"image={image}", f"output={out}"))
    _ok(seg_predict_here(f"run={run}", *OPTS, *args, "keep_store=true"))
    assert (out.parent / ".s.tif.zarr").is_dir() and out.is_file()
    # what a run killed inside discard() leaves: the store renamed, partly deleted
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    doomed = out.parent / f".s.tif.discarded.{dead}-0a1b2c3d.tmp"
    (doomed / "labels" / "c" / "0").mkdir(parents=True)
    (doomed / "labels" / "c" / "0" / "0").write_bytes(b"\0" * 1000)
    labels = out.read_bytes()
    again = _ok(seg_predict_here(f"run={run}", *OPTS, *args))
    assert again["reused"] == 1 if archive else again["tiles_resumed"] == again["tiles"]
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".")) == []
    assert out.read_bytes() == labels
    assert _ok(seg_predict_here(f"run={run}", *OPTS, *args, "overwrite=true"))
    assert out.read_bytes() == labels


def test_a_finished_output_of_another_tile_size_names_the_tile_size(run, tmp_path):
    """A rerun with another grid (tile_size=auto on another processes= or device) or layout
    (layout=auto decides per thread count) is another prediction; the refusal names the
    keys that differ and what sets them. Before: "another model, input, tiling or options"."""
    image = make_image(tmp_path / "s.tif", 211, 173)
    out = tmp_path / "s_pred.tif"
    _ok(seg_predict_here(f"run={run}", "ckpt=last", f"image={image}", f"output={out}",
                         "tile_size=96", "layout=contiguous"))
    _refused(seg_predict_here(f"run={run}", "ckpt=last", f"image={image}", f"output={out}",
                              "tile_size=128", "layout=contiguous"),
             f"output '{out}' was made by another prediction (differs in batches: batch_size "
             "(and tile_size); grid: tile_size / q (tile_size=auto sizes tiles for the "
             "processes and device)); pass overwrite=true")
    _refused(seg_predict_here(f"run={run}", "ckpt=last", f"image={image}", f"output={out}",
                              "tile_size=96", "layout=channels_last"),
             "(differs in channels_last: layout); pass overwrite=true")
