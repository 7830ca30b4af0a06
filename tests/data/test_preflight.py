"""Preflight: every split's files checked before the first step, pixel facts cached; the
data and tiling groups validated; normalisation worked out from the data."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import warm
from helpers.data import group
from omegaconf import OmegaConf

from seg_at_scale.cli.common import class_names_of
from seg_at_scale.cli.data_setup import check_grids
from seg_at_scale.data.band_stats import BandSums, auto_normalization, sample_sums
from seg_at_scale.data.config import data_config, tiling_config
from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.data.preflight import CACHE_NAME, preflight
from seg_at_scale.data.scenes import find_scenes
from seg_at_scale.data.tiles import GridTiles
from seg_at_scale.errors import ConfigError, InputError
from seg_at_scale.io import RasterReader, write_raster
from seg_at_scale.models import UNet
from seg_at_scale.prediction import PredictOptions
from seg_at_scale.tiling import footprint

SHAPE = (4, 70, 90)


def dataset(root: Path, scene_files, dtype=np.uint8, splits=("train", "val", "test")) -> Path:
    for k, split in enumerate(splits):
        scene_files(root / split, name=f"s{k}", shape=SHAPE, dtype=dtype, seed=k)
    return root


def check(root: Path, **kw):
    args = {"bands": 4, "num_classes": 5, "scale": 1 / 255, "cache": root / CACHE_NAME}
    return preflight(root, ["train", "val", "test"], **{**args, **kw})


def test_nan_in_a_validation_image_is_refused_before_work(tmp_path, scene_files) -> None:
    root = dataset(tmp_path, scene_files, dtype=np.float32)
    image = np.random.default_rng(0).random(SHAPE).astype(np.float32)
    image[2, 33, 40] = np.nan
    write_raster(root / "val" / "s1_image.tif", image, tile=(32, 32), overwrite=True)
    with pytest.raises(InputError, match=r"val/s1_image.tif' has NaN pixels \(first in row 33\)"
                                         r" and no nodata value; set data.nodata=nan"):
        check(root, scale=1.0)
    report = check(root, scale=1.0, nodata=float("nan"))  # masked: accepted
    assert report.dtype == np.float32


def test_header_faults_are_named(tmp_path, scene_files) -> None:
    root = dataset(tmp_path, scene_files)
    with pytest.raises(InputError, match=r"s0_image.tif' has 4 bands but data.bands=3; set "
                                         r"data.bands=4"):
        check(root, bands=3)
    with pytest.raises(ConfigError, match=r"data.scale=0.00392157 maps .*s0_image.tif' "
                                          r"\(uint16, 0..65535\) to 0..257; .*data.scale=auto"):
        check(dataset(tmp_path / "u16", scene_files, dtype=np.uint16))
    test_image = root / "test" / "s2_image.tif"
    test_image.write_bytes(test_image.read_bytes()[:-500])  # a cut copy
    with pytest.raises(InputError, match=r"s2_image.tif' is truncated"):
        check(root)


def test_label_out_of_range_in_a_test_mask(tmp_path, scene_files) -> None:
    root = dataset(tmp_path, scene_files)
    labels = np.zeros(SHAPE[1:], np.uint8)
    labels[60, 7] = 9
    write_raster(root / "test" / "s2_mask.tif", labels, overwrite=True)
    with pytest.raises(InputError, match=r"s2_mask.tif' has label 9 at row 60, col 7, but "
                                         r"data.num_classes=5"):
        check(root)


def test_pixel_facts_are_cached_until_a_file_changes(tmp_path, scene_files) -> None:
    root = dataset(tmp_path, scene_files)
    first = check(root)
    assert (first.checked, first.cached) == (3, 0) and (root / CACHE_NAME).exists()
    counts = {s: [x.class_counts for x in v] for s, v in first.scenes.items()}
    again = check(root)
    assert (again.checked, again.cached) == (0, 3)
    assert {s: [x.class_counts for x in v] for s, v in again.scenes.items()} == counts
    labels = np.full(SHAPE[1:], 7, np.uint8)  # same size, new content: re-read, refused
    write_raster(root / "val" / "s1_mask.tif", labels, overwrite=True)
    with pytest.raises(InputError, match="label 7"):
        check(root)


def test_scenes_in_images_and_masks_folders_are_the_same_scenes(tmp_path, scene_files) -> None:
    paired = dataset(tmp_path / "paired", scene_files)
    scene_files(paired / "train", name="t2", shape=(4, 53, 61), seed=7)
    folders = tmp_path / "folders"
    for image in sorted(paired.glob("*/*_image.tif")):
        name = image.name[: -len("_image.tif")]
        for sub, path in (("images", image), ("masks", image.with_name(f"{name}_mask.tif"))):
            (folders / image.parent.name / sub).mkdir(parents=True, exist_ok=True)
            (folders / image.parent.name / sub / f"{name}.tif").write_bytes(path.read_bytes())
    a, b = check(paired), check(folders)
    assert {k: [(s.name, s.class_counts) for s in v] for k, v in a.scenes.items()} == \
        {k: [(s.name, s.class_counts) for s in v] for k, v in b.scenes.items()}
    assert [s.name for s in b.scenes["train"]] == ["s0", "t2"]
    assert sorted(b.shapes.values()) == sorted(a.shapes.values())
    assert b.scenes["train"][1].mask == folders / "train" / "masks" / "t2.tif"
    fp = UNet(4, 5, levels=2, base_width=2).footprint()  # the training tiles: the same bytes
    tiles = [GridTiles(r.scenes["train"], fp, Normalizer(), q=2) for r in (a, b)]
    assert len(tiles[0]) == len(tiles[1]) == 8
    for i in range(8):
        for key in ("image", "target", "norm"):
            assert torch.equal(tiles[0][i][key], tiles[1][i][key]), (i, key)
    (folders / "val" / "masks" / "s1.tif").unlink()
    with pytest.raises(InputError, match=r"val/images/s1.tif' has no mask: expected "
                                         r"'.*val/masks/s1.tif'"):
        check(folders)
    scene_files(folders / "val", name="s1", shape=SHAPE, seed=1)  # the other layout beside
    with pytest.raises(InputError, match=r"data.root \(val split\): '.*val' holds scenes in "
                                         r"both layouts \('s1_image.tif' and 'images/s1.tif'\)"):
        check(folders)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=r"data.root \(test split\): no scenes in '.*empty'; "
                                         r"give <name>_image.tif with <name>_mask.tif beside "
                                         r"it, or images/<name>.tif with masks/<name>.tif "
                                         r"\(.tif or .tiff, in any case\)"):
        find_scenes(tmp_path / "empty", key="data.root (test split)")


def test_tiff_extensions_in_any_case_are_the_same_scenes(tmp_path, scene_files) -> None:
    """``.TIF`` (GIS tools, Windows) and ``.tiff`` name scenes as ``.tif`` does, in both
    layouts; ``a_image.TIF`` was not a scene at all ("no scenes")."""
    paired = dataset(tmp_path / "paired", scene_files)
    scene_files(paired / "train", name="t2", shape=(4, 53, 61), seed=7)
    renamed = tmp_path / "renamed"
    names = {"s0_image.tif": "s0_image.TIF", "s0_mask.tif": "s0_mask.TIF",
             "t2_image.tif": "t2_image.tiff", "t2_mask.tif": "t2_mask.tif",
             "s1_image.tif": "images/s1.tiff", "s1_mask.tif": "masks/s1.TIF"}
    for path in sorted(paired.glob("*/*.tif")):
        target = renamed / path.parent.name / names.get(path.name, path.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    a, b = check(paired), check(renamed)
    assert {k: [(s.name, s.class_counts) for s in v] for k, v in a.scenes.items()} == \
        {k: [(s.name, s.class_counts) for s in v] for k, v in b.scenes.items()}
    assert [(s.image.name, s.mask.name) for s in b.scenes["train"]] == [
        ("s0_image.TIF", "s0_mask.TIF"), ("t2_image.tiff", "t2_mask.tif")]
    assert b.scenes["val"][0].mask == renamed / "val" / "masks" / "s1.TIF"
    twice = renamed / "val" / "images" / "s1.tif"  # the same scene under a second extension
    twice.write_bytes((renamed / "val" / "images" / "s1.tiff").read_bytes())
    with pytest.raises(InputError, match=re.escape(
            f"'{twice}' and '{twice.with_suffix('.tiff')}' are both scene 's1' (its metrics, "
            "its prediction); keep one of them in the folder")):
        check(renamed)


def test_seg_train_stops_on_a_nan_before_training(tmp_path, scene_files) -> None:
    root = dataset(tmp_path / "scenes", scene_files, dtype=np.float32)
    image = np.ones(SHAPE, np.float32)
    image[0, 5, 5] = np.nan
    write_raster(root / "val" / "s1_image.tif", image, overwrite=True)
    assert refused_before_training(root, tmp_path / "run", classes=5).startswith(
        f"seg-train: error: '{root / 'val' / 's1_image.tif'}' has NaN pixels")


def refused_before_training(root: Path, run: Path, classes: int) -> str:
    """``seg-train`` on the scenes under ``root``: refused, exit 2, no checkpoint and no run
    config written; its last line."""
    cmd = [sys.executable, "-m", "seg_at_scale.cli.train", "data=tiff", f"data.root={root}",
           "data.bands=4", f"data.num_classes={classes}", "logger=csv", "model=unet_tiny",
           f"hydra.run.dir={run}"]
    out = warm.run(cmd, capture_output=True, text=True, timeout=300,
                   env={"PATH": "/usr/bin:/bin", "WANDB_MODE": "offline"})
    assert out.returncode == 2, out.stderr[-2000:]
    assert not (run / "checkpoints").exists() and not (run / "run_config.yaml").exists()
    return out.stderr.strip().splitlines()[-1]


def test_binary_masks_written_0_255_are_refused_before_training(tmp_path, scene_files) -> None:
    """Before: the foreground (255 = data.ignore_index) carried no loss, and seg-train trained
    to the end on the background alone."""
    rng = np.random.default_rng(3)
    root = tmp_path / "scenes"
    truths = {split: rng.random(SHAPE[1:]) < 0.3 for split in ("train", "val", "test")}
    for k, (split, truth) in enumerate(truths.items()):
        scene_files(root / split, name=f"s{k}", shape=SHAPE, seed=k,
                    mask=np.where(truth, 255, 0).astype(np.uint8))
    foreground = int(truths["train"].sum())
    background = SHAPE[1] * SHAPE[2] - foreground
    assert refused_before_training(root, tmp_path / "run", classes=2) == (
        f"seg-train: error: the training masks under '{root / 'train'}' hold only class 0 "
        f"({background} pixels), and {foreground} pixels of 255 (data.ignore_index: no loss): a "
        "network cannot learn 2 classes from them; binary masks written 0 / 255? Write the "
        "foreground as 1 (e.g. gdal_calc.py -A <mask> --calc='A>0' --type=Byte --outfile=<new "
        "mask>)")
    for k, (split, truth) in enumerate(truths.items()):  # the fix it gives: foreground 1
        write_raster(root / split / f"s{k}_mask.tif", truth.astype(np.uint8), overwrite=True)
    report = check(root, num_classes=2)
    assert report.scenes["train"][0].class_counts == [background, foreground]
    for mask in root.rglob("*_mask.tif"):  # one class and nothing ignored: the other fix
        write_raster(mask, np.zeros(SHAPE[1:], np.uint8), overwrite=True)
    with pytest.raises(InputError, match=r"hold only class 0 \(6300 pixels\): a network "
                                         r"cannot learn 2 classes from them; give masks that "
                                         r"hold the labels 0..1$"):
        check(root, num_classes=2)


@pytest.mark.parametrize("values, fragment", [
    ({"q": "abc"}, "tiling.q='abc': give the tiles per side as a whole number >= 1"),
    ({"q": 0}, "tiling.q=0: give the tiles per side"),
    ({"q": [0, 2]}, "tiling.q=[0, 2]: give the tiles per side as a whole number >= 1 (1 = "
                    "the whole image in one tile), [rows, cols] of such numbers"),
    ({"q": [2]}, "tiling.q=[2]: give one number of tiles per side for both axes, or "
                 "[rows, cols]"),
    ({"q": None, "tile_size": None}, "tiling.q and tiling.tile_size are both null"),
    ({"tile_size": -5}, "tiling.tile_size=-5: give the largest input window"),
    ({"batch_size": 2.5}, "tiling.batch_size=2.5"),
    ({"qq": 2}, "tiling.qq is not a tiling key (did you mean tiling.q?): use one of augment, "),
])
def test_tiling_values_are_refused_with_key_and_fix(values, fragment) -> None:
    with pytest.raises(ConfigError) as err:
        tiling_config(group("tiling", "grid", **values))
    assert fragment in str(err.value)


@pytest.mark.parametrize("q", [1, 7, [1, 4], [3, 2], 0, -2, [0, 2], [2], [1, 2, 3], True, 2.5,
                               "2", [1, 2.0], [1, None]])
def test_tiles_per_side_are_one_rule_for_training_and_prediction(q) -> None:
    """``tiling.q`` (seg-train) and ``q`` (seg-predict) take and refuse the same values, and a
    pair reaches both as the same ``(rows, cols)``."""
    def verdict(make):
        try:
            return make().q
        except ConfigError as err:
            return f"refused: {'q=' in str(err)}"

    training = verdict(lambda: tiling_config(group("tiling", "grid", q=q)))
    prediction = verdict(lambda: PredictOptions.from_mapping({"q": q}))
    assert training == prediction
    assert training == (tuple(q) if isinstance(q, list) else q) or training == "refused: True"


def test_tiles_per_side_of_each_axis_reach_the_grid(tmp_path, scene_files) -> None:
    """``tiling.q=[rows, cols]``: a pair, validated, and the grids of the run's scenes have
    that many rows and columns (``check_grids`` names the pair where it cannot tile)."""
    assert tiling_config(group("tiling", "grid", q=[1, 3])).q == (1, 3)
    report = check(dataset(tmp_path, scene_files))
    fp = footprint(UNet(4, 5, levels=3, convs_per_level=2, base_width=4, padding="same"))
    check_grids(OmegaConf.create({"tiling": {"mode": "grid", "q": [1, 3], "tile_size": None}}),
                fp, report)
    cfg = OmegaConf.create({"tiling": {"mode": "grid", "q": [1, 40], "tile_size": None}})
    with pytest.raises(ConfigError, match=r"tiling.q=\[1, 40\] cannot tile val scene "):
        check_grids(cfg, fp, report)


@pytest.mark.parametrize("values, fragment", [
    ({"bands": "four"}, "data.bands='four'"),
    ({"mean": [0.5, 0.5]}, "data.mean has 2 values for data.bands=4"),
    ({"std": [0.0]}, "data.std has 0.0 for band 0: a standard deviation"),
    ({"scale": "1/255"}, "data.scale='1/255': give a positive factor"),
    ({"num_classes": 300}, "at most 254 classes"),
    ({"class_weights": [1.0]}, "data.class_weights has 1 values but data.num_classes=5"),
])
def test_data_values_are_refused_with_key_and_fix(values, fragment) -> None:
    with pytest.raises(ConfigError) as err:
        data_config(group("data", "tiff", **{"root": "x", "bands": 4, "num_classes": 5,
                                              "scale": 1.0, "class_weights": None, **values}))
    assert fragment in str(err.value)


@pytest.mark.parametrize("name, option, key", [("tiling", "random", "batch_size"),
                                               ("data", "streets", "ignore_index")])
def test_a_group_without_a_key_is_refused_naming_it(name, option, key) -> None:
    values = group(name, option, root="x") if name == "data" else group(name, option)
    del values[key]
    check = data_config if name == "data" else tiling_config
    with pytest.raises(ConfigError, match=rf"the {name} group sets no {name}.{key}: add it"):
        check(values)


def test_class_names_default_and_length() -> None:
    assert class_names_of(OmegaConf.create({"num_classes": 3, "class_names": None})) == [
        "class_0", "class_1", "class_2"]
    with pytest.raises(ConfigError, match="data.class_names has 2 names but data.num_classes=3"):
        class_names_of(OmegaConf.create({"num_classes": 3, "class_names": ["a", "b"]}))


def test_a_grid_that_cannot_tile_a_scene_names_key_and_scene(tmp_path, scene_files) -> None:
    report = check(dataset(tmp_path, scene_files))
    fp = footprint(UNet(4, 5, levels=3, convs_per_level=2, base_width=4, padding="same"))
    cfg = OmegaConf.create({"tiling": {"mode": "grid", "q": 40, "tile_size": None}})
    with pytest.raises(ConfigError, match=r"tiling.q=40 cannot tile val scene .*s1_image.tif' "
                                          r"\(70x90.*use a smaller q"):
        check_grids(cfg, fp, report)


def test_sample_statistics_leave_out_no_data(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    image = rng.normal(1000, 100, (2, 300, 300)).astype(np.uint16)
    image[:, :100] = 9999  # no-data rows: must not count
    path = write_raster(tmp_path / "a.tif", image, nodata=9999)
    with RasterReader(path) as r:
        sums = sample_sums(r)
    mean, std = sums.mean_std()
    np.testing.assert_allclose(mean, 1000, rtol=0.02)
    np.testing.assert_allclose(std, 100, rtol=0.1)
    auto = auto_normalization(np.dtype(np.uint16), sums, "auto", "auto", [1.0])
    assert auto["scale"] == pytest.approx(1 / 1300, rel=0.03) and auto["std"] == [1.0]
    assert auto_normalization(np.dtype(np.uint8), BandSums.of(image[:, 100:], None), "auto",
                              [0.5], [0.25])["scale"] == 1 / 255


def test_nan_under_gdal_internal_mask_is_no_data(tmp_path, scene_files) -> None:
    pytest.importorskip("rasterio")
    from helpers.io import write_with_gdal_mask

    root = dataset(tmp_path, scene_files, dtype=np.float32)
    image = np.random.default_rng(0).random(SHAPE).astype(np.float32)
    valid = np.ones(SHAPE[1:], bool)
    valid[10:20, 30:50] = False
    image[:, 12, 35] = np.nan  # only where the mask says no-data
    write_with_gdal_mask(root / "val" / "s1_image.tif", image, valid, tiled=True,
                         blockxsize=32, blockysize=32, compress="deflate")
    assert check(root, scale=1.0).dtype == np.float32
    image[:, 40, 35] = np.nan  # and now also outside it
    (root / "val" / "s1_image.tif").unlink()
    write_with_gdal_mask(root / "val" / "s1_image.tif", image, valid)
    with pytest.raises(InputError, match=r"NaN pixels \(first in row 40\)"):
        check(root, scale=1.0)


@pytest.mark.parametrize("layout", ["paired", "folders"])
def test_a_mask_without_its_image_is_named(tmp_path, scene_files, layout) -> None:
    """Before: a misnamed or deleted image left its scene out of training without a word
    (an image without its mask was refused)."""
    root = dataset(tmp_path, scene_files)
    scene_files(root / "train", name="s9", shape=SHAPE, seed=9)
    if layout == "folders":
        for split in ("train", "val", "test"):
            (root / split / "images").mkdir()
            (root / split / "masks").mkdir()
            for p in sorted((root / split).glob("*_image.tif")):
                p.rename(root / split / "images" / p.name.replace("_image", ""))
            for p in sorted((root / split).glob("*_mask.tif")):
                p.rename(root / split / "masks" / p.name.replace("_mask", ""))
        orphan, image = root / "train" / "masks" / "s9.tif", root / "train" / "images" / "s9.tif"
    else:
        orphan, image = root / "train" / "s9_mask.tif", root / "train" / "s9_image.tif"
    image.rename(tmp_path / "elsewhere.tif")  # deleted, or renamed by a slip
    with pytest.raises(InputError) as err:
        check(root)
    assert str(err.value) == (f"mask '{orphan}' has no image: expected '{image}'; name its "
                              "image so, or remove the mask (its scene would be left out of "
                              "training)")


def test_a_colour_mask_is_told_to_become_class_ids(tmp_path, scene_files) -> None:
    """Before: a 3-band mask was advised data.mask_bands, which the tiff group does not
    have (Hydra's error), and which with + ended in a traceback at the first step."""
    root = dataset(tmp_path, scene_files)
    write_raster(root / "val" / "s1_mask.tif", np.zeros((3, *SHAPE[1:]), np.uint8),
                 overwrite=True)
    with pytest.raises(InputError) as err:
        check(root)
    assert str(err.value).endswith(
        "s1_mask.tif' has 3 bands; masks are single-band label images, one class id 0..K-1 "
        "per pixel: write its labels as one band of class ids (a colour mask: one class id "
        "per colour). Labels of each plane of a multi-plane image are data.mask_bands' "
        "(data=cosmic sets it; data.mask_bands=1 now)")
