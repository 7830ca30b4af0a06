"""The synthetic dataset: deterministic, window-independent, learnable, streamable."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from seg_at_scale.cli.synth import main
from seg_at_scale.data import synthetic
from seg_at_scale.data.sources.base import scene_seed
from seg_at_scale.data.sources.synthetic import (
    DatasetManifest,
    make_dataset,
    write_scene,
)
from seg_at_scale.data.synthetic import CLASSES, SceneGenerator
from seg_at_scale.errors import InputError, OutputExistsError
from seg_at_scale.io import RasterReader
from seg_at_scale.tiling.geometry import Window

H, W = 203, 317
BACKGROUND, VEGETATION, WATER, ROAD, BUILDING = range(5)


@pytest.fixture(scope="module")
def scene512() -> tuple[np.ndarray, np.ndarray]:
    return SceneGenerator(0, 512, 512).render(Window(0, 0, 512, 512))


def read(path) -> np.ndarray:
    with RasterReader(path) as r:
        return r.read(Window(0, 0, r.height, r.width))


def test_same_seed_same_scene_other_seed_other_scene():
    win = Window(0, 0, H, W)
    a_img, a_mask = SceneGenerator(7, H, W).render(win)
    b_img, b_mask = SceneGenerator(7, H, W).render(win)
    c_img, c_mask = SceneGenerator(8, H, W).render(win)
    assert a_img.shape == (4, H, W) and a_img.dtype == np.uint8 and a_mask.dtype == np.uint8
    assert np.array_equal(a_img, b_img) and np.array_equal(a_mask, b_mask)
    assert (a_img != c_img).mean() > 0.5
    assert (a_mask != c_mask).mean() > 0.05


def _shadow_pixel(gen: SceneGenerator, window: Window) -> tuple[int, int]:
    look = gen._look(window)  # the appearance map: shadows are a look, not a class
    rows, cols = np.nonzero(look[40:-40, 40:-40] == synthetic.SHADOW)
    rows, cols = rows + 40, cols + 40  # >= 40 px from the window's edges
    assert rows.size, "the test scene should contain building shadows"
    k = rows.size // 2
    return window.row + int(rows[k]), window.col + int(cols[k])


def test_render_is_window_independent():
    gen = SceneGenerator(3, 2000, 2000)
    big = Window(-37, 1001, 411, 523)  # negative rows and odd sizes are fine
    image, mask = gen.render(big)
    sr, sc = _shadow_pixel(gen, big)
    subs = [
        Window(-37, 1001, 1, 1),
        Window(0, 1055, 96, 97),  # straddles city-block cells (pitch 96) and the origin
        Window(95, 1100, 98, 3),
        Window(sr, sc, 40, 40),  # starts inside a building shadow
        Window(sr - 39, sc - 39, 40, 40),  # ends inside it
        Window(sr - 17, big.col, 35, big.width),  # a band of rows through it
    ]
    rng = np.random.default_rng(0)
    for _ in range(12):
        h, w = (int(v) for v in rng.integers(1, 160, 2))
        r = int(rng.integers(big.row, big.row_end - h + 1))
        c = int(rng.integers(big.col, big.col_end - w + 1))
        subs.append(Window(r, c, h, w))
    for sub in subs:
        rows, cols = sub.shift(-big.row, -big.col).slices()
        sub_image, sub_mask = gen.render(sub)
        assert np.array_equal(sub_image, image[:, rows, cols]), sub
        assert np.array_equal(sub_mask, mask[rows, cols]), sub
        assert np.array_equal(gen.render_mask(sub), mask[rows, cols]), sub
    assert np.array_equal(gen.render_mask(big), mask)


def test_big_windows_are_rendered_in_blocks_without_seams():
    gen = SceneGenerator(5, 3000, 3000)
    tall = Window(3, 11, synthetic._BLOCK + 77, 40)  # cut into two blocks internally
    image, mask = gen.render(tall)
    lo, hi = Window(3, 11, 600, 40), Window(603, 11, tall.height - 600, 40)
    assert np.array_equal(np.concatenate([gen.render(lo)[0], gen.render(hi)[0]], 1), image)
    assert np.array_equal(np.concatenate([gen.render_mask(lo), gen.render_mask(hi)]), mask)


def test_other_dtypes_and_bands_are_the_same_levels():
    win = Window(10, 20, 61, 83)
    base, mask = SceneGenerator(2, H, W).render(win)
    six, mask6 = SceneGenerator(2, H, W, bands=6, dtype=np.uint16).render(win)
    flt, _ = SceneGenerator(2, H, W, bands=3, dtype=np.float32).render(win)
    assert six.dtype == np.uint16 and np.array_equal(six[:4], base.astype(np.uint16) * 257)
    assert np.array_equal(mask6, mask)
    assert flt.dtype == np.float32 and np.allclose(flt, base[:3] / 255.0, atol=1e-6)
    with pytest.raises(ValueError, match="bands=7"):
        SceneGenerator(0, H, W, bands=7)
    with pytest.raises(ValueError, match="int32"):
        SceneGenerator(0, H, W, dtype=np.int32)


def test_class_fractions_are_balanced():
    # One 512^2 scene holds only a few lakes and parks, so average eight (seeds 0..7).
    masks = [SceneGenerator(s, 512, 512).render_mask(Window(0, 0, 512, 512)) for s in range(8)]
    counts = np.array([np.bincount(m.ravel(), minlength=len(CLASSES)) for m in masks])
    assert counts.shape[1] == len(CLASSES) and (counts > 0).all(), counts  # all in every scene
    frac = counts.sum(0) / counts.sum()
    lo = np.array([0.30, 0.15, 0.04, 0.06, 0.05])
    hi = np.array([0.50, 0.38, 0.20, 0.15, 0.18])
    assert ((frac >= lo) & (frac <= hi)).all(), dict(zip(CLASSES, frac.round(3), strict=True))


def test_roads_and_buildings_look_alike_other_classes_do_not(scene512):
    image, mask = scene512

    def stats(cls: int) -> tuple[np.ndarray, np.ndarray]:
        px = image[:, mask == cls].astype(np.float64)
        return px.mean(axis=1), px.std(axis=1)

    (road_mean, road_std), (bld_mean, bld_std) = stats(ROAD), stats(BUILDING)
    # Same signature: shape and context (lines vs rectangles with shadows) must decide.
    assert np.abs(road_mean - bld_mean).max() < 3.0, (road_mean, bld_mean)
    assert np.abs(road_std - bld_std).max() < 2.0, (road_std, bld_std)
    means = {c: stats(c)[0] for c in (BACKGROUND, VEGETATION, WATER, ROAD)}
    nir = 3
    assert means[VEGETATION][nir] > means[BACKGROUND][nir] + 30 > means[WATER][nir] + 60
    assert np.abs(means[BACKGROUND] - means[ROAD]).max() > 20  # bare ground is brown
    assert means[WATER].max() < 90


def test_write_scene_streams_exactly(tmp_path):
    gen = SceneGenerator(11, H, W)
    img_path, mask_path = write_scene(tmp_path / "img.tif", tmp_path / "mask.tif", gen,
                                      tile=(64, 64), band_rows=50)  # 50 does not divide 203
    image, mask = gen.render(Window(0, 0, H, W))
    assert np.array_equal(read(img_path), image)
    assert np.array_equal(read(mask_path), mask[None])
    with RasterReader(img_path) as r:
        assert not r.geotags.is_empty
    with pytest.raises(OutputExistsError, match="mask_path"):
        write_scene(tmp_path / "other.tif", mask_path, gen)
    assert not (tmp_path / "other.tif").exists()  # checked before anything is written


def test_make_dataset_creates_reuses_and_guards(tmp_path):
    root = tmp_path / "synth"
    splits = {"train": 2, "val": 1, "test": 1}
    m = make_dataset(root, splits=splits, height=67, width=93, seed=4)
    expected = sorted(f"{s}/scene_{k}_{kind}.tif" for s, n in splits.items()
                      for k in range(n) for kind in ("image", "mask"))
    written = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.tif"))
    assert written == expected and sorted(p.relative_to(root).as_posix()
                                          for p in m.all_files()) == expected
    data = json.loads((root / "manifest.json").read_text())
    assert data["classes"] == list(CLASSES)
    assert data["parameters"]["splits"] == splits and data["parameters"]["seed"] == 4
    assert DatasetManifest.load(root) == m
    img, mask = m.files["val"][0]
    gen = SceneGenerator(scene_seed(4, "val", 0), 67, 93)
    assert np.array_equal(read(img), gen.render(Window(0, 0, 67, 93))[0])
    assert m.seeds["val"][0] == scene_seed(4, "val", 0) != scene_seed(4, "train", 0)

    mtimes = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    again = make_dataset(root, splits=splits, height=67, width=93, seed=4)
    assert again == m
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == mtimes  # nothing rewritten

    with pytest.raises(InputError, match=r"seed: 4 there, 5 asked.*overwrite=true"):
        make_dataset(root, splits=splits, height=67, width=93, seed=5)
    with pytest.raises(InputError, match="width"):
        make_dataset(root, splits=splits, height=67, width=94, seed=4)

    fewer = make_dataset(root, splits={"train": 1, "val": 1, "test": 1}, height=67, width=93,
                         seed=5, overwrite=True)
    assert fewer.parameters["seed"] == 5
    assert not (root / "train" / "scene_1_image.tif").exists()  # stale scene removed
    old_val = gen.render(Window(0, 0, 67, 93))[0]
    assert not np.array_equal(read(fewer.files["val"][0][0]), old_val)  # regenerated


def test_make_dataset_regenerates_missing_files(tmp_path):
    m = make_dataset(tmp_path, splits={"train": 1}, height=40, width=50)
    m.files["train"][0][1].unlink()
    again = make_dataset(tmp_path, splits={"train": 1}, height=40, width=50)
    assert again.files["train"][0][1].exists()


def test_cli_single_and_dataset(tmp_path, capsys, monkeypatch):
    img, mask = tmp_path / "a.tif", tmp_path / "a_mask.tif"
    args = ["--single", str(img), str(mask), "--height", "97", "--width", "131", "--seed", "9",
            "--band-rows", "40"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert str(img) in out and "Mpix/s" in out
    image, labels = SceneGenerator(9, 97, 131).render(Window(0, 0, 97, 131))
    assert np.array_equal(read(img), image) and np.array_equal(read(mask), labels[None])
    with pytest.raises(SystemExit) as exit_:
        main(args)  # exists, no --overwrite
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("seg-synth: error: ") and "overwrite" in err and "Traceback" not in err
    assert main(args + ["--overwrite"]) == 0
    ds = tmp_path / "ds"
    assert main(["--out", str(ds), "--height", "40", "--width", "44", "--train", "1",
                 "--val", "1", "--test", "0"]) == 0
    assert (ds / "manifest.json").exists() and (ds / "val" / "scene_0_mask.tif").exists()
    monkeypatch.chdir(tmp_path / "ds" / "val")
    before = sorted(Path().rglob("*"))
    for args in (["--out", "s3://bucket/ds"], ["--single", "gs://b/a.tif", "a_mask.tif"]):
        with pytest.raises(SystemExit) as exit_:
            main([*args, "--height", "40", "--width", "44"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"seg-synth: error: {args[0]} '{args[1]}' is a URL "
                              f"({args[1].split(':')[0]}:): seg_at_scale reads and writes local "
                              "files only"), err
        assert "write to a local or mounted folder, then copy the result there" in err
    assert sorted(Path().rglob("*")) == before  # no 's3:' folder, no a_mask.tif
