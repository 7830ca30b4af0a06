"""CosmicTagger data (real larcv3 file, tiny files written here, synthetic), loss, metrics,
and the cosmic experiment configs."""

from __future__ import annotations

import doctest
import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.cli import assert_plain_checkpoints
from helpers.data import tiff_module
from helpers.sources import tiny_event, write_larcv
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from seg_at_scale.data.scenes import find_scenes, validate_scene
from seg_at_scale.data.sources.cosmic import (
    IMAGE_GROUP,
    LABEL_GROUP,
    CosmicEvents,
    CosmicH5,
    read_cosmic_h5,
    synthetic_event,
)
from seg_at_scale.errors import ConfigError, InputError
from seg_at_scale.io import read_raster
from seg_at_scale.tasks.cosmic import CosmicLoss, cosmic_confusion, cosmic_metrics
from seg_at_scale.tiling import Footprint

ROOT = Path(__file__).resolve().parents[2]
REAL = Path(os.environ.get("COSMIC_H5", ROOT / "data" / "cosmic_tagging_light.h5"))
CONF = str(ROOT / "seg_at_scale" / "conf")

def test_reader_decodes_tiny_files_written_in_the_real_layout(tmp_path):
    events = [tiny_event(0), tiny_event(1, (3, 8, 4))]
    path = write_larcv(tmp_path / "tiny.h5", events)
    got = list(read_cosmic_h5(path))
    assert len(got) == 2
    for ev, (image, labels) in zip(got, events):
        assert np.array_equal(ev.image, image) and np.array_equal(ev.labels, labels)
    # a chosen subset, downsampled: max over 2 x 2 blocks (labels: neutrino > cosmic > bkg)
    (ev,) = read_cosmic_h5(path, [0], downsample=2)
    image, labels = events[0]
    assert ev.image.shape == (3, 3, 5)
    assert ev.image[1, 2, 3] == image[1, 4:6, 6:8].max()
    assert ev.labels[2, 1, 4] == labels[2, 2:4, 8:10].max()


def test_reader_errors_name_file_and_fix(tmp_path):
    path = write_larcv(tmp_path / "tiny.h5", [tiny_event(0)])
    with pytest.raises(InputError, match="event 3 is not in .*1 events"):
        list(read_cosmic_h5(path, [3]))
    with pytest.raises(InputError, match="data.synthetic.options.downsample=4 does not divide "
                       "the 6 x 10"):
        list(read_cosmic_h5(path, downsample=4))
    give = ("give data.synthetic.options.path (or the COSMIC_H5 variable) the path of a "
            "CosmicTagger larcv3 .h5 file")
    with pytest.raises(InputError) as err:  # before: named data.h5.path, which is no key
        list(read_cosmic_h5(tmp_path / "missing.h5"))
    assert str(err.value) == f"CosmicTagger file '{tmp_path / 'missing.h5'}' does not exist; {give}"
    (tmp_path / "text.h5").write_text("not hdf5")
    with pytest.raises(InputError) as err:  # before: h5py's OSError traceback
        list(read_cosmic_h5(tmp_path / "text.h5"))
    assert str(err.value).startswith(f"'{tmp_path / 'text.h5'}' is not an HDF5 file (")
    assert str(err.value).endswith(f"); {give}")
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = 1
    with pytest.raises(InputError, match=f"no group '{IMAGE_GROUP}'"):
        list(read_cosmic_h5(tmp_path / "other.h5"))


@pytest.mark.skipif(not REAL.exists(), reason=f"real CosmicTagger file not found at {REAL}")
def test_reader_decodes_the_real_file():
    with h5py.File(REAL, "r") as f:
        g, s = f[IMAGE_GROUP], f[LABEL_GROUP]
        meta, vext = g["image_meta"][:], g["voxel_extents"][:]
        vox, lab = g["voxels"][:], s["voxels"][:]
    events = list(read_cosmic_h5(REAL))
    assert len(events) == 5
    for e, ev in enumerate(events):
        for p in range(3):
            j = 3 * e + p
            n0, n1 = (int(v) for v in meta[j]["number_of_voxels"])
            assert ev.image[p].shape == (n1, n0) == (1280, 2048)
            # direct densification, written independently: pixel (row, col) = (id % n1, id // n1)
            lo, n = int(vext[j]["first"]), int(vext[j]["N"])
            ids = vox["id"][lo : lo + n].astype(np.int64)
            dense = np.zeros((n1, n0), np.float32)
            dense[ids % n1, ids // n1] = vox["value"][lo : lo + n]
            assert np.array_equal(ev.image[p], dense)
            counts = np.bincount(lab["value"][lo : lo + n].astype(np.int64), minlength=3)
            counts[0] += n1 * n0 - n  # pixels without a voxel are background
            assert np.array_equal(np.bincount(ev.labels[p].ravel(), minlength=3), counts)
    total = sum(np.bincount(ev.labels.ravel(), minlength=3) for ev in events)
    assert total[1:].tolist() == [103664, 24001]  # cosmic, neutrino voxels in the file


# ----- synthetic events and the scene writers ---------------------------------------------


def test_synthetic_events_are_seeded_and_detector_like():
    a, b = synthetic_event(128, 200, seed=5), synthetic_event(128, 200, seed=5)
    assert np.array_equal(a.image, b.image) and np.array_equal(a.labels, b.labels)
    assert not np.array_equal(a.image, synthetic_event(128, 200, seed=6).image)
    assert set(np.unique(a.labels)) == {0, 1, 2}
    assert (a.image[a.labels > 0] >= 5).all()  # labels only on charge above threshold
    assert (a.image > 0).mean() < 0.1  # sparse
    # consistent views: rows are the drift coordinate, common to the three planes
    for cls in (1, 2):
        rows = [np.nonzero((a.labels[p] == cls).any(axis=1))[0] for p in range(3)]
        for r in rows[1:]:
            assert abs(int(r.min()) - int(rows[0].min())) <= 2
            assert abs(int(r.max()) - int(rows[0].max())) <= 2


def test_make_cosmic_dataset_writes_reusable_scenes_with_plane_masks(tmp_path):
    root = CosmicEvents({"train": 2, "val": 1}, 48, 80, seed=3,
                               downsample=2).build(tmp_path / "c")
    scenes = [validate_scene(s, 3, mask_bands=3) for s in find_scenes(root / "train")]
    assert [s.name for s in scenes] == ["event_0", "event_1"]
    image, mask = read_raster(scenes[0].image), read_raster(scenes[0].mask)
    assert image.shape == mask.shape == (3, 48, 80) and image.dtype == np.float32
    assert sum(scenes[0].class_counts) == 3 * 48 * 80
    # the same event at full resolution, max-pooled, is what was stored
    full = CosmicEvents({"train": 1}, 96, 160, seed=3).build(tmp_path / "f")
    big = read_raster(full / "train" / "event_0_mask.tif")
    assert np.array_equal(mask, big.reshape(3, 48, 2, 80, 2).max(axis=(2, 4)))
    stamp = scenes[0].image.stat().st_mtime_ns
    CosmicEvents({"train": 2, "val": 1}, 48, 80, seed=3, downsample=2).build(tmp_path / "c")
    assert scenes[0].image.stat().st_mtime_ns == stamp  # reused
    with pytest.raises(InputError, match="other parameters .*seed"):
        CosmicEvents({"train": 2, "val": 1}, 48, 80, seed=4,
                            downsample=2).build(tmp_path / "c")
    with pytest.raises(InputError, match="data.mask_bands=1"):
        validate_scene(find_scenes(root / "val")[0], 3, mask_bands=1)


def test_converter_and_tiles_give_per_plane_targets(tmp_path):
    events = [tiny_event(k, (3, 16, 24)) for k in range(3)]
    path = write_larcv(tmp_path / "tiny.h5", events)
    root = CosmicH5({"train": 2, "val": 1}, path=path).build(tmp_path / "scenes")
    assert np.array_equal(read_raster(root / "val" / "event_2_mask.tif"), events[2][1])
    assert np.array_equal(read_raster(root / "train" / "event_1_image.tif"), events[1][0])
    with pytest.raises(InputError, match="asks for 4 events but .* holds 3"):
        CosmicH5({"train": 4}, path=path).build(tmp_path / "x")
    dm = tiff_module(root, Footprint(4, 4, "same"), 3, tiling="grid", q=2,
                     data={"mask_bands": 3, "class_weights": [1, 1.5, 10]})
    ds = dm.val_dataloader().dataset
    sample = ds[len(ds) - 1]
    assert sample["image"].shape[0] == 3 and sample["target"].shape[0] == 3
    core = sample["core"].tolist()
    labels = torch.from_numpy(events[2][1].astype(np.int64))
    r, c, h, w = core
    assert torch.equal(sample["target"][:, -h:, -w:], labels[:, r : r + h, c : c + w])
    counts = np.bincount(events[2][1].ravel(), minlength=3)
    assert float(sample["norm"]) == pytest.approx(counts @ np.array([1, 1.5, 10]))
    random = tiff_module(root, Footprint(4, 4, "same"), 3, tiling="random", core_size=8,
                         samples_per_epoch=4, batch_size=2, data={"mask_bands": 3})
    batch = next(iter(random.train_dataloader()))
    assert batch["image"].shape[:2] == (2, 3) and batch["target"].shape[:2] == (2, 3)


# ----- loss balancing and metrics ----------------------------------------------------------


def hand_made() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 3, 5, dtype=torch.float64)  # 2 planes x 3 classes
    target = torch.tensor([0, 0, 0, 0, 1, 1, 2, 0, 0, 255] * 3).reshape(1, 2, 3, 5).repeat(
        2, 1, 1, 1)
    return logits, target


def manual_nll(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-pixel NLL written out: plane p's class k is channel p * 3 + k."""
    out = torch.zeros(target.shape, dtype=logits.dtype)
    for b, p, i, j in itertools_product(target.shape):
        t = int(target[b, p, i, j])
        if t != 255:
            z = logits[b, 3 * p : 3 * p + 3, i, j]
            out[b, p, i, j] = torch.logsumexp(z, 0) - z[t]
    return out


def itertools_product(shape):
    import itertools

    return itertools.product(*(range(n) for n in shape))


@pytest.mark.parametrize("balance", ["none", "light", "even", "focal"])
def test_loss_balancing_matches_formulas(balance):
    logits, target = hand_made()
    nll = manual_nll(logits, target)
    valid = target != 255
    n = torch.stack([(target == k).sum() for k in range(3)]).double()  # 28, 8, 4 (+4 ignored)
    weights = {"none": torch.ones(3), "light": torch.tensor([1.0, 1.5, 10.0]),
               "even": n.sum() / (3 * n), "focal": torch.ones(3)}[balance].double()
    w = weights[target.clamp(0, 2)] * valid
    per_pixel = nll * w
    if balance == "focal":
        per_pixel = (1 - torch.exp(-nll)) ** 2 * nll * valid
    loss = CosmicLoss(2, 3, balance)
    s, total = loss(logits, target)
    assert torch.allclose(s, per_pixel.sum()) and torch.allclose(total.double(), w.sum())
    if balance == "even":  # every present class carries the same total weight
        assert torch.allclose(torch.stack([w[target == k].sum() for k in range(3)]),
                              torch.full((3,), float(valid.sum()) / 3, dtype=torch.float64))
    if balance == "none":
        ref = F.cross_entropy(logits.reshape(2, 2, 3, 3, 5).transpose(1, 2), target,
                              ignore_index=255)
        assert torch.allclose(s / total, ref)


def test_even_weights_skip_absent_classes_and_freeze():
    target = torch.tensor([[[[0, 0, 0, 1]]]])
    loss = CosmicLoss(1, 3, "even")
    assert torch.allclose(loss.class_weights(target), torch.tensor([4 / 6, 4 / 2, 0.0]))
    frozen = loss.frozen(target)
    assert torch.allclose(frozen.class_weights(torch.zeros(1, 1, 1, 1, dtype=torch.long)),
                          torch.tensor([4 / 6, 4 / 2, 0.0]))
    with pytest.raises(ConfigError, match="task.balance='heavy'"):
        CosmicLoss(3, 3, "heavy")


def test_even_power_softens_the_even_weights():
    target = torch.tensor([[[[0, 0, 0, 0, 0, 0, 1, 2]]]])  # n = 6, 1, 1 of N = 8
    even = torch.tensor([8 / 18, 8 / 3, 8 / 3])
    for p in (1.0, 0.5, 0.25):
        got = CosmicLoss(1, 3, "even", even_power=p).class_weights(target)
        assert torch.allclose(got, even**p)
    assert torch.allclose(CosmicLoss(1, 3, "light", even_power=0.5).class_weights(target),
                          torch.tensor([1.0, 1.5, 10.0]))  # only `even` is affected
    for bad in (0.0, 1.5, -1.0):
        with pytest.raises(ConfigError, match=rf"task.even_power={bad!r}.*\(0, 1\]"):
            CosmicLoss(1, 3, "even", even_power=bad)


def test_metrics_match_definitions_per_plane_and_averaged():
    target = torch.tensor([[[0, 0, 1, 1, 2, 255], [0, 1, 1, 2, 2, 0]]]).reshape(1, 2, 1, 6)
    pred = torch.tensor([[[0, 1, 1, 0, 2, 2], [0, 1, 2, 2, 2, 0]]]).reshape(1, 2, 1, 6)
    cm = cosmic_confusion(pred, target)
    assert cm[0].tolist() == [[1, 1, 0], [1, 1, 0], [0, 0, 1]]
    m = cosmic_metrics(cm)
    # plane 0: 3 of 5 right; non-bkg labels 3, right 2; cosmic 1/(2+2-1); neutrino 1/1
    assert m["plane0_acc"] == pytest.approx(3 / 5)
    assert m["plane0_acc_nonbg"] == pytest.approx(2 / 3)
    assert m["plane0_iou_cosmic"] == pytest.approx(1 / 3)
    assert m["plane0_iou_neutrino"] == pytest.approx(1.0)
    assert m["plane0_miou"] == pytest.approx((1 / 3 + 1) / 2)
    # plane 1: 5 of 6; non-bkg 4, right 3; cosmic 1/2; neutrino 2/3
    assert m["plane1_acc"] == pytest.approx(5 / 6)
    assert m["plane1_miou"] == pytest.approx((1 / 2 + 2 / 3) / 2)
    assert m["miou"] == pytest.approx(((1 / 3 + 1) / 2 + (1 / 2 + 2 / 3) / 2) / 2)
    assert m["acc_nonbg"] == pytest.approx((2 / 3 + 3 / 4) / 2)
    empty = cosmic_metrics(torch.tensor([[[5, 0, 0], [0, 0, 0], [0, 0, 0]]]))
    assert math.isnan(empty["iou_neutrino"]) and math.isnan(empty["miou"])


# ----- configs --------------------------------------------------------------------------

TINY = ["trainer=fast", "logger=csv", "model=uresnet_tiny", "data.synthetic.height=96",
        "data.synthetic.width=160", "data.synthetic.splits={train:2,val:1}"]


@pytest.mark.parametrize("experiment,ds,height", [("cosmic_uresnet", 1, 1280),
                                                  ("cosmic_uresnet_ds2", 2, 640)])
def test_cosmic_experiments_compose(experiment, ds, height):
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={experiment}"])
    fp = instantiate(cfg.model).footprint()  # the stored events are whole-image steps
    syn = cfg.data.synthetic
    assert (syn.height, syn.width) == (1280 // ds, 2048 // ds) and syn.height == height
    assert syn.height % fp.align == 0 and syn.width % fp.align == 0
    assert cfg.task.planes == cfg.model.planes == cfg.data.mask_bands == cfg.data.bands
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={experiment}", "data=cosmic_h5"])
    assert cfg.data.synthetic.generator.endswith(".CosmicH5")


def test_cosmic_quick_composes():
    """The 15-minute CPU recipe (experiments/learn_cosmic.py): BN UResNet d6/8, even^0.5."""
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=["experiment=cosmic_quick"])
    net = instantiate(cfg.model)
    fp = net.footprint()
    assert fp.halo == 288 and 320 % fp.align == 0 and 512 % fp.align == 0  # whole-image steps
    assert sum(p.numel() for p in net.parameters()) < 1_500_000
    syn = cfg.data.synthetic  # one grid tile = the whole stored event
    assert syn.height % fp.align == 0 and syn.width % fp.align == 0 and cfg.tiling.q == 1
    # balance=even weights the batch itself: a fixed grid normaliser would disagree with it
    assert cfg.task.balance != "light" and cfg.data.class_weights is None


@pytest.mark.slow  # make test-all; the property is also proven by faster tests
def test_cosmic_experiment_trains_a_fast_step(tmp_path):
    cmd = [sys.executable, "-m", "seg_at_scale.cli.train", "experiment=cosmic_uresnet_ds2",
           *TINY, f"hydra.run.dir={tmp_path / 'run'}"]
    env = {"SEG_DATA_DIR": str(tmp_path / "data"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 0.0 <= summary["val/miou"] <= 1.0 and summary["computed"]["align"] == 4
    logged = (tmp_path / "run").rglob("metrics.csv")
    header = next(logged).read_text().splitlines()[0]
    for key in ("val/miou", "val/acc_nonbg", "val/iou_neutrino", "val/plane2_miou"):
        assert key in header
    assert (tmp_path / "data" / "cosmic_96x160_ds2_s0" / "manifest.json").exists()
    assert assert_plain_checkpoints(tmp_path / "run") >= 2  # UResNet + the cosmic task


@pytest.mark.parametrize("name", ["seg_at_scale.models.uresnet", "seg_at_scale.data.sources.cosmic",
                                  "seg_at_scale.tasks.cosmic"])
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.slow
@pytest.mark.skipif(not REAL.exists(), reason=f"real CosmicTagger file not found at {REAL}")
def test_real_file_experiment_converts_and_trains_a_fast_step(tmp_path):
    cmd = [sys.executable, "-m", "seg_at_scale.cli.train", "experiment=cosmic_uresnet",
           "data=cosmic_h5", "data.synthetic.options.downsample=4", "trainer=fast",
           "logger=csv", "model=uresnet_tiny", f"data.synthetic.options.path={REAL}",
           f"hydra.run.dir={tmp_path / 'run'}"]
    env = {"SEG_DATA_DIR": str(tmp_path / "data"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert read_raster(tmp_path / "data" / "cosmic_h5_ds4" / "test" / "event_4_mask.tif"
                       ).shape == (3, 320, 512)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["computed"]["scene_size"] == [320, 512]
