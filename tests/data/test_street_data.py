"""Street-scene data for Gated-SCNN: synthetic streets, Cityscapes and TACO in their real
formats (tiny trees / JSON written here), and every Gated-SCNN config running a fast step."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import pytorch_lightning as pl
from helpers import warm
from helpers.sources import CS_EXPECTED, write_cityscapes, write_taco
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from seg_at_scale.cli.data_setup import checked_groups, synthesize
from seg_at_scale.data.sources.cityscapes import CITYSCAPES_CLASSES, Cityscapes, label_lut
from seg_at_scale.data.sources.streets import (
    STREET_CLASSES,
    Streets,
    canny_band,
    fit_scene,
    render_street,
)
from seg_at_scale.data.sources.taco import Taco, load_taco
from seg_at_scale.errors import ConfigError, InputError
from seg_at_scale.io import read_raster
from seg_at_scale.models.checkpoint import load_checkpoint
from seg_at_scale.models.trained import footprint_with_halo

CONF = str(Path(__file__).resolve().parents[2] / "seg_at_scale" / "conf")



pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_street_scenes_are_seeded_and_written_with_their_canny_band(tmp_path):
    a, b = render_street(96, 160, 3), render_street(96, 160, 3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(render_street(96, 160, 4)[0], a[0])
    splits = {"train": 3, "val": 1}
    Streets(splits, 120, 200, seed=0).build(tmp_path / "s")
    image = read_raster(tmp_path / "s" / "train" / "street_0_image.tif")
    assert image.shape == (4, 120, 200) and set(np.unique(image[3])) <= {0, 255}
    np.testing.assert_array_equal(image[3], canny_band(image[:3]))
    masks = [read_raster(p) for p in sorted((tmp_path / "s").glob("*/*_mask.tif"))]
    assert len(masks) == 4
    assert set(np.unique(np.stack(masks))) == set(range(len(STREET_CLASSES)))
    stamp = (tmp_path / "s" / "train" / "street_0_image.tif").stat().st_mtime_ns
    Streets(splits, 120, 200, seed=0).build(tmp_path / "s")  # reused, not rewritten
    assert (tmp_path / "s" / "train" / "street_0_image.tif").stat().st_mtime_ns == stamp
    with pytest.raises(InputError, match="seed: 0 there, 1 asked"):
        Streets(splits, 120, 200, seed=1).build(tmp_path / "s")


def test_canny_band_refuses_non_rgb_and_fit_scene_halves():
    with pytest.raises(InputError, match=r"RGB uint8 image \[3, H, W\], got float32"):
        canny_band(np.zeros((3, 8, 8), np.float32))
    rgb, mask = render_street(100, 180, 0)
    small_rgb, small_mask = fit_scene(rgb, mask, 50, 1000)
    assert small_rgb.shape == (3, 50, 90) and small_mask.shape == (50, 90)
    np.testing.assert_array_equal(small_mask, cv2.resize(mask, (90, 50),
                                                         interpolation=cv2.INTER_NEAREST))


# ----- Cityscapes -------------------------------------------------------------------------


def test_cityscapes_tree_converts_to_train_ids(tmp_path):
    src = tmp_path / "cityscapes"
    train = write_cityscapes(src, "train", "aachen", 2) | write_cityscapes(src, "train", "bonn", 1,
                                                                             seed=1)
    val = write_cityscapes(src, "val", "lindau", 1, seed=2)
    Cityscapes({"train": 0, "val": 0, "test": 1}, source=src).build(tmp_path / "out")
    assert len(CITYSCAPES_CLASSES) == 19 and CITYSCAPES_CLASSES[13] == "car"
    assert all(label_lut()[i] == t for i, t in CS_EXPECTED.items())
    for split, pairs in (("train", train), ("val", val), ("test", val)):
        for stem, (rgb, ids) in pairs.items():
            mask = read_raster(tmp_path / "out" / split / f"{stem}_mask.tif")[0]
            want = np.vectorize(CS_EXPECTED.get)(ids)
            np.testing.assert_array_equal(mask, want)
            image = read_raster(tmp_path / "out" / split / f"{stem}_image.tif")
            np.testing.assert_array_equal(image[:3], rgb)
            np.testing.assert_array_equal(image[3], canny_band(rgb))
    assert len(list((tmp_path / "out" / "train").glob("*_mask.tif"))) == 3


def test_cityscapes_missing_label_and_missing_source_are_named(tmp_path, monkeypatch):
    src = tmp_path / "cs"
    write_cityscapes(src, "train", "aachen", 1)
    label = next((src / "gtFine").rglob("*.png"))
    label.unlink()
    with pytest.raises(InputError, match="expected '.*aachen_000000_000019_gtFine_labelIds.png'"):
        Cityscapes({"train": 0}, source=src).build(tmp_path / "out")
    with pytest.raises(InputError, match="point \\$CITYSCAPES_DATASET at the folder"):
        Cityscapes({"val": 0}, source=src).build(tmp_path / "out")

    monkeypatch.delenv("CITYSCAPES_DATASET", raising=False)
    with pytest.raises(ConfigError, match="data.synthetic.options.source or \\$CITYSCAPES"):
        Cityscapes({"train": 0}).build(tmp_path / "o")


# ----- TACO ------------------------------------------------------------------------------


def test_taco_polygons_rasterise_to_categories_and_supercategories(tmp_path):
    write_taco(tmp_path / "taco")
    index = load_taco(tmp_path / "taco")
    assert index.class_names == ("background", "Bottle cap", "Glass bottle", "Plastic bottle")
    Taco({"train": 1, "val": 1}, seed=0, source=tmp_path / "taco").build(tmp_path / "cat")
    masks = {p.name: read_raster(p)[0] for p in (tmp_path / "cat").glob("*/*_mask.tif")}
    m1, m2 = masks["taco_000001_mask.tif"], masks["taco_000002_mask.tif"]
    assert m1[20, 30] == 2 and m1[13, 13] == 1 and m1[2, 2] == 0 and m1[40, 50] == 0
    big = (m1 == 2).sum() + (m1 == 1).sum()  # the cap sits on the bottle
    assert abs(big - 36 * 26) <= 36 + 26  # polygon area, up to one pixel along the outline
    assert m2[10, 45] == 3 and m2[33, 10] == 3  # both polygons of one object
    assert m2[38, 4] == 0 and m2[2, 2] == 0
    assert len(list((tmp_path / "cat").glob("*/*_mask.tif"))) == 2
    image = read_raster(next((tmp_path / "cat").glob("*/taco_000001_image.tif")))
    want = cv2.imread(str(tmp_path / "taco" / "batch_1" / "000001.png"))[..., ::-1]
    np.testing.assert_array_equal(image[:3], want.transpose(2, 0, 1))
    Taco({"train": 2}, source=tmp_path / "taco", classes="supercategory").build(
        tmp_path / "sup")
    sup = {p.name: read_raster(p)[0] for p in (tmp_path / "sup").glob("*/*_mask.tif")}
    assert sup["taco_000001_mask.tif"][20, 30] == 1 and sup["taco_000001_mask.tif"][13, 13] == 2
    assert sup["taco_000002_mask.tif"][10, 45] == 1


def test_taco_bad_annotations_are_named(tmp_path):
    write_taco(tmp_path / "taco")
    doc = json.loads((tmp_path / "taco" / "annotations.json").read_text())
    doc["annotations"][0]["category_id"] = 99
    (tmp_path / "taco" / "annotations.json").write_text(json.dumps(doc))
    with pytest.raises(InputError, match="annotation 1 has category 99"):
        load_taco(tmp_path / "taco")
    with pytest.raises(InputError, match="no '.*annotations.json'"):
        load_taco(tmp_path)
    write_taco(tmp_path / "t2")
    with pytest.raises(ConfigError, match="asks for 5 TACO images but"):
        Taco({"train": 5}, source=tmp_path / "t2").build(tmp_path / "o")


# ----- every Gated-SCNN config runs a fast step --------------------------------------------

TINY = ["trainer=fast", "logger=none", "model=gscnn_tiny", "tiling.core_size=32",
        "tiling.batch_size=2", "tiling.samples_per_epoch=4", "tiling.tile_size=400",
        "tiling.augment=null", "task.channels_last=false"]


def _fast_fit(tmp_path: Path, overrides: list[str], epochs: int = 6) -> dict[str, float]:
    """Build data, model and task from the composed config (as ``seg-train`` does) and train
    them on one repeated batch; the losses of the steps and the validation metrics."""
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=[*TINY, *overrides])
    synthesize(cfg)
    data, tiling = checked_groups(cfg)
    model = instantiate(cfg.model)
    dm = instantiate(cfg.data, _partial_=True, _convert_="all")(
        tiling=tiling, footprint=footprint_with_halo(model, cfg.tiling.halo), seed=cfg.seed)
    task = instantiate(cfg.task, model=model)
    losses: list[float] = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    pl.seed_everything(0)
    trainer = pl.Trainer(max_epochs=epochs, overfit_batches=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[Losses()], default_root_dir=str(tmp_path))
    trainer.fit(task, datamodule=dm)
    assert data.num_classes == task.num_classes == cfg.data.num_classes
    trainer.save_checkpoint(tmp_path / "fit.ckpt")  # what seg-train's checkpoints hold:
    load_checkpoint(tmp_path / "fit.ckpt")  # plain data (weights_only), the task's too
    return {"first": losses[0], "last": losses[-1], "steps": len(losses),
            **{k: float(v) for k, v in trainer.callback_metrics.items()}}


def _check(metrics: dict[str, float]) -> None:
    """The config's model, loss and optimiser learn: one batch, seen again, costs less."""
    assert metrics["steps"] == 6 and math.isfinite(metrics["first"])
    assert metrics["last"] < 0.97 * metrics["first"], metrics
    assert 0.0 <= metrics["val/miou"] <= 1.0 and 0.0 <= metrics["val/boundary_f"] <= 1.0


def test_streets_config_runs_a_fast_step(tmp_path):
    _check(_fast_fit(tmp_path, ["data=streets", "task=gscnn",
                                f"data.root={tmp_path / 'streets'}", "data.synthetic.height=96",
                                "data.synthetic.width=136",
                                "data.synthetic.splits={train:1,val:1}"]))


def test_gscnn_cityscapes_experiment_runs_a_fast_step(tmp_path):
    src = tmp_path / "cs"
    write_cityscapes(src, "train", "aachen", 2, size=(64, 96))
    write_cityscapes(src, "val", "lindau", 1, seed=3, size=(64, 96))
    _check(_fast_fit(tmp_path, ["experiment=gscnn_cityscapes", f"data.root={tmp_path / 'o'}",
                                f"data.synthetic.options.source={src}"]))


def test_taco_waste_experiment_runs_a_fast_step(tmp_path):
    write_taco(tmp_path / "taco")
    _check(_fast_fit(tmp_path, ["experiment=taco_waste", f"data.root={tmp_path / 'o'}",
                                f"data.synthetic.options.source={tmp_path / 'taco'}",
                                "data.synthetic.splits={train:1,val:1,test:0}",
                                "data.num_classes=3"]))
    # the experiment's supercategory table: plastic and glass bottles share one label
    masks = {p.name: read_raster(p)[0] for p in (tmp_path / "o").glob("*/*_mask.tif")}
    glass, plastic = masks["taco_000001_mask.tif"][20, 30], masks["taco_000002_mask.tif"][10, 45]
    assert glass == plastic != 0


@pytest.mark.slow
def test_train_cli_on_streets_predicts_the_test_scene(tmp_path):
    cmd = [sys.executable, "-m", "seg_at_scale.cli.train", "data=streets",
           "task=gscnn", "trainer=fast", "logger=csv", "model=gscnn_tiny",
           "data.synthetic.height=96", "data.synthetic.width=136",
           "data.synthetic.splits={train:1,val:1,test:1}", "tiling.core_size=32",
           "tiling.samples_per_epoch=4", "tiling.batch_size=2", "tiling.tile_size=400",
           "predict.tile_size=400", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "SEG_DATA_DIR": str(tmp_path / "data"), "WANDB_MODE": "offline"}
    out = warm.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 0.0 <= summary["test"][0]["miou"] <= 1.0
    log = (tmp_path / "run" / "train.log").read_text()
    assert "image pooling sees each training/validation tile" in log
