"""seg-predict images=: many scenes in one run, byte-identical to one run per scene."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import rasterio
from helpers import warm
from helpers.prediction import env, make_model, make_run, seg_predict_here
from rasterio.windows import from_bounds

from seg_at_scale.io import example_geotags, read_raster, write_raster

SIZES = {"s0": (203, 171), "s1": (97, 131), "s2": (311, 257), "s3": (64, 60)}
OPTS = ("ckpt=last", "tile_size=96", "preview=false")


def _scene(path: Path, height: int, width: int, seed: int, origin: tuple[float, float]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    img = np.stack([np.sin(yy / (7 + b)) * np.cos(xx / (11 + b)) for b in range(4)]) * 90
    img = (img + 128 + rng.normal(0, 20, img.shape)).clip(0, 255).astype(np.uint8)
    return write_raster(path, img, tile=(64, 64),
                        geotags=example_geotags(origin=origin, pixel_size=10.0))


def _origin(k: int) -> tuple[float, float]:
    return (500000.0 + 3000.0 * k, 4500000.0 - 1000.0 * k)  # side by side, no overlap


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    """Four scenes of different sizes, their masks, a run, and one run per scene."""
    tmp = tmp_path_factory.mktemp("archive")
    run = make_run(tmp / "run", make_model("same", levels=3, width=8))
    for k, (stem, (h, w)) in enumerate(SIZES.items()):
        _scene(tmp / "scenes" / f"{stem}.tif", h, w, k, _origin(k))
        (tmp / "masks").mkdir(exist_ok=True)
        write_raster(tmp / "masks" / f"{stem}_mask.tif",
                     (read_raster(tmp / "scenes" / f"{stem}.tif")[0] // 52).astype(np.uint8))
        res = seg_predict_here(f"run={run}", f"image={tmp / 'scenes' / f'{stem}.tif'}",
                               f"output={tmp / 'single' / f'{stem}.tif'}",
                               f"mask={tmp / 'masks' / f'{stem}_mask.tif'}", *OPTS)
        assert res.returncode == 0, res.stderr
    return tmp, run


def _cmd(run: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "seg_at_scale.cli.predict", f"run={run}", "progress=false",
            *OPTS, *args]


def _archive(run: Path, *args: str, processes: int = 1) -> dict:
    if processes == 1:
        res = seg_predict_here(f"run={run}", *OPTS, *args)
    else:
        res = warm.run(_cmd(run, *args, f"processes={processes}"), capture_output=True,
                       text=True, env=env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout[res.stdout.index("{"):])


def _rows(out: Path) -> dict[str, dict]:
    with (out / "summary.csv").open() as f:
        return {r["stem"]: r for r in csv.DictReader(f)}


@pytest.mark.parametrize("processes", [1, 2, 3])
def test_an_archive_equals_one_run_per_scene_whatever_the_ranks(archive, processes):
    tmp, run = archive
    out = tmp / f"out{processes}"
    res = _archive(run, f"images={tmp / 'scenes'}", f"output_dir={out}",
                   f"masks={tmp / 'masks'}", processes=processes)
    assert (res["scenes"], res["done"], res["failed"]) == (4, 4, 0)
    rows = _rows(out)
    for stem in SIZES:
        assert (out / f"{stem}.tif").read_bytes() == (tmp / "single" / f"{stem}.tif").read_bytes()
        single = json.loads((tmp / "single" / f"{stem}.stac.json").read_text())
        assert single["id"] == stem and (out / f"{stem}.stac.json").exists()
        labels = read_raster(out / f"{stem}.tif")[0]  # one count per class (5), as image=
        assert json.loads(rows[stem]["class_pixels"]) == np.bincount(
            labels[labels != 255], minlength=5).tolist()
    big = json.loads(rows["s2"]["tiles_by_rank"])
    assert len(big) == processes and all(n > 0 for n in big)  # every rank had tiles of s2
    assert sum(int(r["tiles_computed"]) for r in rows.values()) == sum(
        int(r["tiles"]) for r in rows.values())


def test_scores_mosaic_and_items_of_an_archive(archive):
    tmp, run = archive
    out = tmp / "out1"
    if not (out / "summary.csv").exists():
        _archive(run, f"images={tmp / 'scenes'}", f"output_dir={out}", f"masks={tmp / 'masks'}")
    rows = _rows(out)
    for stem in SIZES:
        alone = seg_predict_here(f"run={run}", f"image={tmp / 'scenes' / f'{stem}.tif'}",
                                 f"output={tmp / 'single' / f'{stem}.tif'}",
                                 f"mask={tmp / 'masks' / f'{stem}_mask.tif'}", *OPTS)
        assert float(rows[stem]["miou"]) == json.loads(alone.stdout)["miou"]
    with rasterio.open(out / "mosaic.vrt") as vrt:
        for stem in SIZES:
            with rasterio.open(out / f"{stem}.tif") as one:
                window = from_bounds(*one.bounds, transform=vrt.transform)
                np.testing.assert_array_equal(vrt.read(1, window=window), one.read(1))
        assert vrt.crs is not None and vrt.nodata == 255
    items = json.loads((out / "items.json").read_text())
    assert sorted(f["id"] for f in items["features"]) == sorted(SIZES)


@pytest.mark.parametrize("layout", ["paired", "folders"])
def test_a_split_folder_of_a_training_layout_predicts_its_images_scored_by_its_masks(
        archive, tmp_path, layout):
    """Before: ``images=<split>`` predicted the masks too (as images), named the scenes
    ``s0_image``, and ``masks=<split>`` found no truth for them."""
    import shutil

    tmp, run = archive
    split = tmp_path / "test"
    for stem in SIZES:
        image, mask = ((split / f"{stem}_image.tif", split / f"{stem}_mask.tif")
                       if layout == "paired" else
                       (split / "images" / f"{stem}.tif", split / "masks" / f"{stem}.tif"))
        for src, dst in ((tmp / "scenes" / f"{stem}.tif", image),
                         (tmp / "masks" / f"{stem}_mask.tif", mask)):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    out = tmp_path / "out"
    res = _archive(run, f"images={split}", f"output_dir={out}", f"masks={split}")
    assert (res["scenes"], res["done"], res["failed"]) == (4, 4, 0)
    rows = _rows(out)
    assert sorted(rows) == sorted(SIZES)  # the scenes' names, no mask among them
    every_label, every_truth = [], []
    for stem in SIZES:
        assert (out / f"{stem}.tif").read_bytes() == (tmp / "single" / f"{stem}.tif").read_bytes()
        truth = read_raster(tmp / "masks" / f"{stem}_mask.tif")[0]
        labels = read_raster(out / f"{stem}.tif")[0]
        assert rows[stem]["miou"] != "", stem  # scored: its mask was found
        assert float(rows[stem]["miou"]) == pytest.approx(_miou(labels, truth, 5), abs=5e-5)
        every_label.append(labels.ravel())
        every_truth.append(truth.ravel())
    # the archive's own score: over all its pixels at once (before: none; the scenes' mean
    # mIoU weighs the smallest scene as much as the largest)
    pooled = _miou(np.concatenate(every_label), np.concatenate(every_truth), 5)
    assert res["score"]["scenes"] == 4
    assert res["score"]["miou"] == pytest.approx(pooled, abs=5e-5)
    assert res["score"]["miou"] != pytest.approx(
        np.mean([float(r["miou"]) for r in rows.values()]), abs=5e-5)
    assert json.loads((out / "summary.json").read_text())["score"] == res["score"]


def _miou(labels: np.ndarray, truth: np.ndarray, classes: int) -> float:
    """The mean IoU over the classes present in the prediction or the truth."""
    ious = [((labels == k) & (truth == k)).sum() / ((labels == k) | (truth == k)).sum()
            for k in range(classes) if ((labels == k) | (truth == k)).any()]
    return float(np.mean(ious))


def test_a_killed_archive_reruns_only_what_is_left_and_a_new_scene_alone(archive, tmp_path):
    tmp, run = archive
    scenes = tmp_path / "scenes"
    scenes.mkdir()
    for stem in SIZES:
        (scenes / f"{stem}.tif").write_bytes((tmp / "scenes" / f"{stem}.tif").read_bytes())
    out = tmp_path / "out"
    proc = warm.popen(_cmd(run, f"images={scenes}", f"output_dir={out}", "tile_size=64"),
                      env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while not (out / "s0.tif").exists():  # the first scene is finished
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    unfinished = [stem for stem in SIZES if not (out / f"{stem}.tif").exists()]
    for stem in unfinished:  # temporaries a dead writer left beside the unfinished scenes
        (out / f".{stem}.tif.cog.{ended}-0a1b2c3d.tmp").write_bytes(b"x")
    again = _archive(run, f"images={scenes}", f"output_dir={out}", "tile_size=64")
    rows = _rows(out)
    assert rows["s0"]["status"] == "reused" and int(rows["s0"]["tiles_computed"]) == 0
    assert unfinished and not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    assert again["reused"] >= 1 and again["done"] + again["reused"] == 4
    ref = tmp_path / "ref"
    _archive(run, f"images={scenes}", f"output_dir={ref}", "tile_size=64")
    for stem in SIZES:
        assert (out / f"{stem}.tif").read_bytes() == (ref / f"{stem}.tif").read_bytes()
    _scene(scenes / "s4.tif", 141, 99, 9, _origin(4))  # a scene added later
    last = _archive(run, f"images={scenes}", f"output_dir={out}", "tile_size=64")
    rows = _rows(out)
    assert (last["done"], last["reused"]) == (1, 4) and rows["s4"]["status"] == "done"
    assert all(int(rows[s]["tiles_computed"]) == 0 for s in SIZES)


def test_bad_scenes_stop_before_any_tile_or_are_skipped_and_recorded(archive, tmp_path):
    tmp, run = archive
    scenes = tmp_path / "scenes"
    scenes.mkdir()
    for stem in ("s0", "s1"):
        (scenes / f"{stem}.tif").write_bytes((tmp / "scenes" / f"{stem}.tif").read_bytes())
    data = (tmp / "scenes" / "s2.tif").read_bytes()
    (scenes / "cut.tif").write_bytes(data[: len(data) // 2])  # truncated
    write_raster(scenes / "rgb.tif", np.zeros((3, 70, 90), np.uint8))  # 3 bands, model: 4
    out = tmp_path / "out"
    stop = seg_predict_here(f"run={run}", *OPTS, f"images={scenes}", f"output_dir={out}")
    assert stop.returncode == 2
    line = stop.stderr.strip().splitlines()
    assert len(line) == 1 and "2 of 4 scenes cannot be predicted" in line[0]
    assert "cut: " in line[0] and "truncated" in line[0] and "rgb: " in line[0]
    assert "has 3 bands" in line[0] and not out.exists()
    assert "Re-copy or re-generate it; rgb: " in line[0]  # each reason without its full stop
    res = _archive(run, f"images={scenes}", f"output_dir={out}", "on_error=skip")
    assert (res["done"], res["skipped"]) == (2, 2)
    rows = _rows(out)
    assert rows["cut"]["status"] == rows["rgb"]["status"] == "skipped"
    assert "truncated" in rows["cut"]["reason"] and "has 3 bands" in rows["rgb"]["reason"]
    for stem in ("s0", "s1"):  # copies of the scenes: the same labels (their paths differ)
        assert read_raster(out / f"{stem}.tif").tobytes() == read_raster(
            tmp / "single" / f"{stem}.tif").tobytes()


def test_a_stac_item_collection_names_the_scenes(archive, tmp_path):
    tmp, run = archive
    features = [{"type": "Feature", "stac_version": "1.0.0", "id": f"scene-{stem}",
                 "geometry": None, "properties": {"datetime": "2026-01-01T00:00:00Z"},
                 "links": [], "assets": {"image": {
                     "href": f"../{tmp.name}/scenes/{stem}.tif",
                     "type": "image/tiff; application=geotiff", "roles": ["data"]}}}
                for stem in ("s1", "s3")]
    (tmp_path / "items.json").write_text(json.dumps(
        {"type": "FeatureCollection", "features": features}))
    (tmp.parent / tmp_path.name).mkdir(exist_ok=True)  # relative hrefs resolve beside it
    listing = tmp.parent / tmp_path.name / "items.json"
    listing.write_text((tmp_path / "items.json").read_text())
    out = tmp_path / "out"
    res = _archive(run, f"images={listing}", f"output_dir={out}")
    assert res["done"] == 2
    for stem in ("s1", "s3"):
        got = (out / f"scene-{stem}.tif").read_bytes()
        assert got == (tmp / "single" / f"{stem}.tif").read_bytes()


def test_one_merged_vector_file_for_the_archive(archive, tmp_path):
    import geopandas as gpd

    tmp, run = archive
    out = tmp_path / "out"
    res = _archive(run, f"images={tmp / 'scenes'}", f"output_dir={out}", "vector=gpkg",
                   "vector_merge=true", "vector_min_area=0")
    merged = gpd.read_file(res["vectors"])
    assert sorted(merged["scene"].unique()) == sorted(SIZES)
    items = {i["id"]: i for i in json.loads((out / "items.json").read_text())["features"]}
    for stem in SIZES:  # the merged rows of a scene are that scene's own polygons
        piece = gpd.read_file(out / "vectors" / f"{stem}.gpkg")
        assert int(merged.loc[merged["scene"] == stem, "pixels"].sum()) == int(
            piece["pixels"].sum()) == int((read_raster(out / f"{stem}.tif")[0] != 255).sum())
        # each scene's Item names its own polygons, in a folder a static host publishes
        # (one whose name starts with a dot is skipped by many)
        href = items[stem]["assets"]["vectors"]["href"]  # relative to items.json
        assert href == f"./vectors/{stem}.gpkg"
    assert not list(out.glob("s0.gpkg")) and merged.crs is not None


def test_a_scene_that_fails_mid_read_is_skipped_and_the_stream_goes_on(archive, tmp_path):
    """The scenes run as one stream of batches (the next scene's first tiles read while
    the last batch of one runs): a scene whose tile cannot be decoded, found only when its
    turn comes (it passes every check before the work), is recorded and skipped with
    ``on_error=skip`` and the scenes after it are predicted as alone; with
    ``on_error=stop`` the run ends on it, naming the file."""
    import tifffile

    tmp, run = archive
    scenes = tmp_path / "scenes"
    scenes.mkdir()
    for stem in ("s0", "s1", "s2"):
        (scenes / f"{stem}.tif").write_bytes((tmp / "scenes" / f"{stem}.tif").read_bytes())
    with tifffile.TiffFile(scenes / "s1.tif") as tif:
        page = tif.pages[0]
        offset, count = page.dataoffsets[-1], page.databytecounts[-1]  # a border tile
    data = bytearray((scenes / "s1.tif").read_bytes())
    data[offset : offset + count] = bytes(range(256)) * (count // 256) + bytes(count % 256)
    (scenes / "s1.tif").write_bytes(bytes(data))
    out = tmp_path / "out"
    stop = seg_predict_here(f"run={run}", *OPTS, f"images={scenes}", f"output_dir={out}")
    assert stop.returncode == 2 and "cannot decode" in stop.stderr, stop.stderr
    assert "s1.tif" in stop.stderr.strip().splitlines()[-1]
    res = _archive(run, f"images={scenes}", f"output_dir={out}", "on_error=skip")
    rows = _rows(out)
    assert rows["s1"]["status"] == "failed" and "cannot decode" in rows["s1"]["reason"]
    assert res["failed"] == 1 and not (out / "s1.tif").exists()
    for stem in ("s0", "s2"):
        assert rows[stem]["status"] in ("done", "reused")
        assert read_raster(out / f"{stem}.tif").tobytes() == read_raster(
            tmp / "single" / f"{stem}.tif").tobytes()


def test_merged_polygons_of_two_crss_are_measured_in_one_and_without_a_crs_refused(archive,
                                                                                  tmp_path):
    """Before: a scene in Web Mercator was reprojected into the merged layer with its
    ``area`` still in Web Mercator's units, and a scene without georeferencing was merged,
    its pixel coordinates placed as if they were the layer's metres."""
    import geopandas as gpd

    tmp, run = archive
    scenes = tmp_path / "scenes"
    scenes.mkdir()
    (scenes / "s0.tif").write_bytes((tmp / "scenes" / "s0.tif").read_bytes())  # UTM 33N
    pixels = read_raster(tmp / "scenes" / "s1.tif")
    write_raster(scenes / "web.tif", pixels, tile=(64, 64),
                 geotags=example_geotags((1670000.0, 5000000.0), 10.0, epsg=3857))
    out = tmp_path / "out"
    res = _archive(run, f"images={scenes}", f"output_dir={out}", "vector=gpkg",
                   "vector_merge=true", "vector_min_area=0")
    merged = gpd.read_file(res["vectors"])
    assert merged.crs.to_epsg() == 32633
    web = merged[merged["scene"] == "web"]
    piece = gpd.read_file(out / "vectors" / "web.gpkg")
    assert piece.crs.to_epsg() == 3857 and len(web) == len(piece) > 0
    np.testing.assert_allclose(web["area"].to_numpy(),
                               piece.to_crs(32633).geometry.area.to_numpy(), rtol=1e-9)
    assert web["area"].sum() < 0.7 * piece["area"].sum()  # Mercator's areas, shrunk

    write_raster(scenes / "plain.tif", pixels, tile=(64, 64))  # no georeferencing
    out = tmp_path / "out2"
    res = seg_predict_here(f"run={run}", *OPTS, f"images={scenes}", f"output_dir={out}",
                           "vector=gpkg", "vector_merge=true")
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == (
        "seg-predict: error: vector_merge=true: scene 'plain' has no CRS (its polygons are in "
        "pixel coordinates) and scene 's0' is in EPSG:32633: their polygons cannot share one "
        "layer and nothing was computed; predict them as two archives, or drop vector_merge "
        "(one polygon file per scene)")
    assert not out.exists() or not list(out.glob("*.tif"))


@pytest.mark.parametrize("name", ["summary.csv", "summary.json", "items.json", "mosaic.vrt",
                                  "vectors.gpkg"])
def test_a_users_file_under_a_report_name_is_refused_before_any_tile(archive, tmp_path,
                                                                     name):
    """Before: an archive replaced the user's summary.csv, summary.json, items.json and
    mosaic.vrt in output_dir without a word (vectors.gpkg with vector_merge=true)."""
    tmp, run = archive
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_text("the user's own\n")
    args = (f"run={run}", *OPTS, f"images={tmp / 'scenes'}", f"output_dir={out}",
            "vector=gpkg", "vector_merge=true")
    res = seg_predict_here(*args)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == (
        f"seg-predict: error: output_dir '{out}' holds {name}, which the archive's report "
        "writes and no archive prediction wrote; pass overwrite=true to replace it, or choose "
        "another output_dir")
    assert sorted(p.name for p in out.iterdir()) == [name]  # no tile, nothing else
    assert (out / name).read_text() == "the user's own\n"
    if name != "vectors.gpkg":  # replaced and rerun once: the binary one
        return
    first = seg_predict_here(*args, "overwrite=true")
    assert first.returncode == 0, first.stderr[-2000:]
    assert (out / name).read_bytes() != b"the user's own\n"
    again = seg_predict_here(*args)  # the archive's own report: a rerun replaces it
    assert again.returncode == 0, again.stderr[-2000:]
    report = json.loads((out / "summary.json").read_text())
    assert report["reused"] == 4 and (out / "mosaic.vrt").is_file()


def test_a_mosaic_of_an_earlier_set_of_crss_is_removed_and_a_users_kept(archive, tmp_path):
    """Before: after an archive's scenes changed CRSs, mosaic.vrt (or mosaic_<epsg>.vrt) of
    the earlier run stayed beside the new ones, describing scenes it no longer held."""
    import shutil

    tmp, run = archive
    out = tmp_path / "out"
    args = (f"images={tmp / 'scenes'}", f"output_dir={out}")
    _archive(run, *args)
    shutil.copy(out / "mosaic.vrt", out / "mosaic_4326.vrt")  # one the earlier run wrote
    (out / "mosaic_mine.vrt").write_text("<VRTDataset/>")  # the user's: never removed
    res = _archive(run, *args, "overwrite=true")
    assert res["mosaics"] == [str(out / "mosaic.vrt")]
    assert sorted(p.name for p in out.glob("mosaic*.vrt")) == ["mosaic.vrt", "mosaic_mine.vrt"]
    assert (out / "mosaic_mine.vrt").read_text() == "<VRTDataset/>"


def test_every_scene_finished_by_another_prediction_is_named_in_one_refusal(archive,
                                                                           tmp_path):
    """Before: ``on_error=stop`` named the first such scene only (its docs: every bad scene
    in one message), so each fix met the next refusal."""
    tmp, run = archive
    out = tmp_path / "out"
    _archive(run, f"images={tmp / 'scenes'}", f"output_dir={out}")
    res = seg_predict_here(f"run={run}", *OPTS, f"images={tmp / 'scenes'}",
                           f"output_dir={out}", "tile_size=128")
    assert res.returncode == 2, res.stderr[-2000:]
    line = res.stderr.strip().splitlines()[-1]
    # s3 (64 x 60) is one tile at either size: the same prediction, reused
    assert line.startswith("seg-predict: error: 3 of 4 scenes have an output or store of "
                           "another prediction, so nothing was computed: s0: output "), line
    assert all(f"{stem}: output '{out / stem}.tif' was made by another prediction (differs "
               "in batches" in line for stem in ("s0", "s1", "s2")), line
