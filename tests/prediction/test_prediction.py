"""Prediction at scale: the file path is exact, outputs are identical under any number of
processes and after a kill, the COG is valid, TTA is exact, bad input is refused first."""

from __future__ import annotations

import json
import marshal
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from helpers import warm
from helpers.prediction import (
    CLASSES,
    CLI_SHAPE,
    NORM,
    chunks_written,
    env,
    leftovers,
    make_image,
    make_model,
    make_run,
    predict_cmd,
    seg_predict,
)

import seg_at_scale
from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.errors import ConfigError, OutputExistsError
from seg_at_scale.io import read_raster
from seg_at_scale.prediction import predict_raster
from seg_at_scale.prediction.options import PredictOptions
from seg_at_scale.tiling import predict_full, predict_full_tta, predict_tiled

NORMALIZER = Normalizer(NORM["scale"], tuple(NORM["mean"]), tuple(NORM["std"]))
FAST64 = PredictOptions(tile_size=64, progress=False)


def _reference(model, image, tta=None):
    x = torch.from_numpy(NORMALIZER(read_raster(image)))[None]
    with torch.no_grad():
        if tta:
            return predict_full_tta(model, x, tta)[0]
        return torch.softmax(predict_full(model, x), 1)[0]


@pytest.mark.parametrize(("padding", "layout"), [("same", "auto"), ("valid", "auto"),
                                                  ("same", "contiguous")])
def test_file_prediction_equals_untiled_forward(tmp_path, padding, layout, one_torch_thread):
    """517 x 743 (not a multiple of the alignment 8), mean 0.5 / std 0.25: every pixel,
    borders included, equals the untiled network on the normalised image. (Zero-filling
    raw pixels before normalising, as the file path did, changed ~0.4 % of the labels.)
    The exact fp32 path runs its tiles channels-last by default (faster on CPU) against the
    contiguous untiled forward; ``layout=contiguous`` gives the same labels."""
    model = make_model(padding, levels=4, width=4)
    image = make_image(tmp_path / "a.tif")
    options = PredictOptions(tile_size=160, probabilities="float16", progress=False,
                             layout=layout)
    assert options.channels_last == (layout == "auto") and options.autocast is None
    stats = predict_raster(model, image, tmp_path / "a.zarr", options, normalizer=NORMALIZER)
    ref = _reference(model, image)
    store = zarr.open_group(tmp_path / "a.zarr", mode="r")
    assert stats.tiles > 20 and store.attrs["complete"]
    np.testing.assert_array_equal(store["labels"][:], ref.argmax(0).numpy())
    np.testing.assert_allclose(store["probabilities"][:].astype(np.float32), ref.numpy(),
                               atol=1e-3)
    assert sum(stats.class_pixels) == 517 * 743


def test_q_per_axis_tiles_rows_and_columns_apart_and_equals_untiled(tmp_path, one_torch_thread):
    """``q=[rows, cols]``: a strip takes its own number of tiles per axis, in Python
    (``PredictOptions(q=(2, 3))``) and on the command line (``seg-predict q=[2,3]``); every
    pixel of a 203 x 611 scene equals the untiled network (in process) and the command's
    one-tile output; a pair that is not two whole numbers >= 1 is refused naming it."""
    model = make_model("same", levels=4, width=4)
    image = make_image(tmp_path / "a.tif", height=203, width=611)
    stats = predict_raster(model, image, tmp_path / "a.zarr",
                           PredictOptions(q=(2, 3), progress=False), normalizer=NORMALIZER)
    assert stats.tiles == 6
    labels = zarr.open_group(tmp_path / "a.zarr", mode="r")["labels"][:]
    np.testing.assert_array_equal(labels, _reference(model, image).argmax(0).numpy())

    run = make_run(tmp_path / "run", model)
    tiled = seg_predict(run, image, tmp_path / "q23.tif", "q=[2,3]", "preview=false")
    whole = seg_predict(run, image, tmp_path / "q1.tif", "q=1", "preview=false")
    assert (tiled["tiles"], whole["tiles"]) == (6, 1)
    np.testing.assert_array_equal(read_raster(tmp_path / "q23.tif"),
                                  read_raster(tmp_path / "q1.tif"))
    for bad, said in (([0, 2], "q=[0, 2]: give tiles per side as a whole number >= 1"),
                      ([2], "q=(2,) is not a whole number or a list of 2 (a whole number) "
                            "or null; give q=<")):
        with pytest.raises(ConfigError, match=re.escape(said)):
            PredictOptions.from_mapping({"q": bad})


@pytest.mark.parametrize("tta", ["flips", "d4"])
@pytest.mark.parametrize("padding", ["same", "valid"])
def test_tta_equals_tta_of_the_untiled_image(padding, tta, one_torch_thread):
    model = make_model(padding, levels=3, width=4)
    x = torch.randn(1, 4, 83, 61)
    tiled = predict_tiled(model, x, tile_size=64, tta=tta)
    full = predict_full_tta(model, x, tta)
    assert (tiled - full).abs().max() < 1e-6
    assert not torch.allclose(full, torch.softmax(predict_full(model, x), 1), atol=1e-3)


def test_file_tta_equals_untiled_tta(tmp_path, one_torch_thread):
    model = make_model("same", levels=3, width=4)
    image = make_image(tmp_path / "a.tif", 141, 97)
    predict_raster(model, image, tmp_path / "a.zarr",
                   PredictOptions(tile_size=64, probabilities="float16", tta="d4",
                                  progress=False), normalizer=NORMALIZER)
    ref = _reference(model, image, tta="d4")
    got = zarr.open_group(tmp_path / "a.zarr", mode="r")["probabilities"][:]
    np.testing.assert_allclose(got.astype(np.float32), ref.numpy(), atol=1e-3)


def _arrays(store):
    g = zarr.open_group(store, mode="r")
    return g["labels"][:], g["probabilities"][:]


@pytest.mark.slow  # make test-all; the property is also proven by faster tests
def test_processes_give_byte_identical_zarr_and_cog(cli_case, tmp_path):
    """processes = 1, 2, 3: the same labels and probabilities, and the same COG bytes,
    overviews included (the scene is wider than one 512 block: GDAL's rule gives it a
    level); the COG passes GDAL's COG rules and carries the input's georeferencing."""
    import rasterio
    from helpers.prediction import make_image
    from rio_cogeo.cogeo import cog_validate

    from seg_at_scale.io.overviews import overview_shapes

    run, _ = cli_case
    image = make_image(tmp_path / "wide.tif", 263, 601)
    outs = {}
    for n in (1, 2, 3):
        out = tmp_path / f"p{n}" / "mask.tif"
        res = seg_predict(run, image, out, f"processes={n}", "tile_size=144",
                          "probabilities=uint8", "keep_store=true")
        assert res["processes"] == n and res["tiles"] >= 12
        outs[n] = out
    labels, probs = _arrays(outs[1].with_name(".mask.tif.zarr"))
    assert len(np.unique(labels)) > 1
    for n in (2, 3):
        other = _arrays(outs[n].with_name(".mask.tif.zarr"))
        np.testing.assert_array_equal(other[0], labels)
        np.testing.assert_array_equal(other[1], probs)
        assert outs[n].read_bytes() == outs[1].read_bytes()
        prob_tif = outs[n].with_name("mask_probabilities.tif")
        assert prob_tif.read_bytes() == outs[1].with_name("mask_probabilities.tif").read_bytes()
    valid, errors, _ = cog_validate(str(outs[1]))
    assert valid, errors
    with rasterio.open(image) as src, rasterio.open(outs[1]) as cog:
        assert (cog.width, cog.height, cog.crs, cog.transform) == (
            src.width, src.height, src.crs, src.transform)
        levels = overview_shapes(cog.height, cog.width, cog.block_shapes[0][0])
        assert len(levels) == 1  # so the bytes compared above hold an overview
        assert cog.overviews(1) == [2 ** (i + 1) for i in range(len(levels))]  # GDAL's rule
        assert cog.nodata == 255 and cog.profile["tiled"]
        assert cog.colormap(1)[1][:3] != cog.colormap(1)[2][:3]
        np.testing.assert_array_equal(cog.read(1), labels)
    with rasterio.open(outs[1].with_name("mask_probabilities.tif")) as p:
        assert p.count == 5 and p.descriptions == tuple(CLASSES)
        np.testing.assert_array_equal(p.read(), probs)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_prediction_resumes_to_the_uninterrupted_output(cli_case, cli_reference, tmp_path,
                                                               sig):
    run, image = cli_case
    ref = cli_reference
    out = tmp_path / "killed" / "mask.tif"
    out.parent.mkdir()
    proc = warm.popen(predict_cmd(run, image, out, "tile_size=64"), env=env(),
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    store = out.with_name(".mask.tif.zarr")
    deadline = time.time() + 120
    while chunks_written(store) < 6 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(sig)
    proc.wait(60)
    assert proc.returncode != 0 and not out.exists()
    done = chunks_written(store)
    assert done >= 6
    if sig == signal.SIGTERM:  # unwound: no temporary file left beside the output
        assert leftovers(out.parent, out.name) == []
        assert proc.returncode == 143
        assert "run the same command again to resume" in proc.stderr.read().decode()
    res = seg_predict(run, image, out, "tile_size=64")
    assert res["tiles_resumed"] >= done - 1  # a chunk being renamed at the kill may count
    assert res["tiles_computed"] == res["tiles"] - res["tiles_resumed"]
    assert read_raster(out).tobytes() == read_raster(ref).tobytes()
    assert out.read_bytes() == ref.read_bytes()
    # the COG was being written beside the tiles: what SIGKILL left of it is removed
    assert leftovers(out.parent, out.name) == []


def test_a_killed_zarr_overwrite_keeps_the_old_output_and_resumes(cli_case, cli_reference,
                                                                   tmp_path):
    """Before: a ``.zarr`` output was its own working store, so a killed run left an
    unfinished store (``complete: false``) under the output's name, and ``overwrite=true``
    deleted the finished output it replaced before its first tile. Now the tiles go to
    ``.mask.zarr``, renamed to ``mask.zarr`` when complete."""
    from seg_at_scale.prediction.provenance import finished

    run, image = cli_case
    out = tmp_path / "mask.zarr"
    _here(run, image, out, "tile_size=160")
    old = finished(out)
    assert old is not None
    proc = warm.popen(predict_cmd(run, image, out, "tile_size=64", "overwrite=true"), env=env(),
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    store = tmp_path / ".mask.zarr"
    deadline = time.time() + 120
    while chunks_written(store) < 6 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    done = chunks_written(store)
    assert proc.returncode != 0 and done >= 6
    assert finished(out) == old  # the replaced output, whole, until the new one is complete
    res = _here(run, image, out, "tile_size=64", "overwrite=true")
    assert res["tiles_resumed"] >= done - 1  # a chunk being renamed at the kill may count
    np.testing.assert_array_equal(zarr.open_group(out, mode="r")["labels"][:],
                                  read_raster(cli_reference)[0])
    assert finished(out) != old and not store.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".mask.zarr")] == []


def test_second_writer_is_refused_and_first_completes(cli_case, tmp_path):
    run, image = cli_case
    out = tmp_path / "mask.tif"
    first = warm.popen(predict_cmd(run, image, out, "tile_size=64"), env=env(),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    store = out.with_name(".mask.tif.zarr")
    while chunks_written(store) < 1 and first.poll() is None:
        time.sleep(0.01)
    assert first.poll() is None
    os.kill(first.pid, signal.SIGSTOP)  # held mid-run (else it may finish before the second)
    try:
        second = seg_predict(run, image, out, "tile_size=64", "overwrite=true", check=False)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert second.returncode != 0
    assert "being written by another run" in second.stderr and ".mask.output.lock" in second.stderr
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr[-2000:]
    assert json.loads(stdout[stdout.index("{"):])["tiles_computed"] > 0
    assert read_raster(out).shape == (1, *CLI_SHAPE)


def test_disk_full_leaves_nothing_under_the_final_name_and_reruns(cli_case, tmp_path):
    run, image = cli_case
    out = tmp_path / "mask.tif"

    # no .pyc from the limited process: CPython renames a bytecode file cut at the limit
    # into __pycache__, and every later process importing that module fails to unmarshal it;
    # the COG's temporary plain TIFF (~99 KB) cannot be written
    proc = warm.run(predict_cmd(run, image, out, "tile_size=160"),
                    env={**env(), "PYTHONDONTWRITEBYTECODE": "1"}, capture_output=True,
                    text=True, limits={"RLIMIT_FSIZE": (50_000, 50_000)}, timeout=300)
    # one line, exit 2: before, numpy's short write ("N requested and M written", no errno)
    # went out as a traceback with exit 1
    assert proc.returncode == 2 and not out.exists(), proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()[-1:]
    assert re.fullmatch(r"seg-predict: error: no space left \(.*\); free space or choose "
                        r"another output folder, then run the same command again: what was "
                        r"finished is kept", line), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert leftovers(tmp_path, out.name) == []
    package = Path(seg_at_scale.__file__).parent
    for pyc in package.rglob("*.pyc"):  # whole: a cut one fails every later import of it
        marshal.loads(pyc.read_bytes()[16:])
    res = seg_predict(run, image, out, "tile_size=160")
    assert res["tiles_computed"] == 0 and res["tiles_resumed"] == res["tiles"]
    assert read_raster(out).shape == (1, *CLI_SHAPE)


def test_a_store_of_another_model_is_refused(tmp_path, one_torch_thread):
    image = make_image(tmp_path / "a.tif", 97, 131)
    out = tmp_path / "a.zarr"
    first = make_model(seed=0)
    with pytest.raises(KeyboardInterrupt):
        predict_raster(first, image, out, FAST64, normalizer=_Interrupt(after=2))
    before = sorted(p.name for p in out.rglob("*"))
    with pytest.raises(OutputExistsError, match="differs in: model.*resume=false"):
        predict_raster(make_model(seed=1), image, out, FAST64)
    assert sorted(p.name for p in out.rglob("*")) == before
    predict_raster(make_model(seed=1), image, out,
                   PredictOptions(tile_size=64, progress=False, resume=False))
    assert zarr.open_group(out, mode="r").attrs["complete"]


class _Interrupt(Normalizer):
    """A normaliser that interrupts the run after ``after`` windows (a user's Ctrl-C)."""

    def __init__(self, after: int) -> None:
        super().__init__()
        object.__setattr__(self, "left", [after])

    def apply_(self, x):  # the engine normalises each batch on the model's thread
        self.left[0] -= 1
        if self.left[0] < 0:
            raise KeyboardInterrupt
        return super().apply_(x)


@pytest.mark.parametrize(("output", "extra", "message"), [
    ("mask.png", (), "extension '.png' names no format"),
    ("scene.tif", ("overwrite=true",), "is the image"),
    ("mask.tif", ("mask={image}",), None),
    ("mask.tif", ("processes=0",), "processes=0: give a whole number >= 1"),
    ("mask.tif", ("processes=2", "q=1", "device=cpu"), "only 1 batch of tiles"),
])
def test_bad_prediction_input_is_refused_before_work(cli_case, tmp_path, output, extra,
                                                     message):
    run, image = cli_case
    out = image if output == "scene.tif" else tmp_path / output
    before = image.read_bytes()
    if "mask={image}" in extra:  # a ground truth of another size
        from seg_at_scale.io import write_raster
        wrong = write_raster(tmp_path / "truth.tif", np.zeros((500, 743), np.uint8))
        extra, message = (f"mask={wrong}",), "is 500x743 but image"
    res = seg_predict(run, image, out, *extra, check=False)
    assert res.returncode != 0 and message in res.stderr, res.stderr[-2000:]
    assert image.read_bytes() == before
    assert not (tmp_path / ".mask.tif.zarr").exists() and not (tmp_path / "mask.tif").exists()


def test_output_kind_and_processes_errors_in_python(tmp_path):
    image = make_image(tmp_path / "a.tif", 40, 40)
    with pytest.raises(ConfigError, match="use .tif"):
        predict_raster(make_model(), image, tmp_path / "a.jpg")


def test_existing_preview_and_unwritable_folder_are_refused_before_work(cli_case, tmp_path):
    run, image = cli_case
    preview = tmp_path / "mask_preview.png"
    preview.write_bytes(b"mine")
    res = seg_predict(run, image, tmp_path / "mask.tif", check=False)
    assert res.returncode != 0 and "preview" in res.stderr and "overwrite=true" in res.stderr
    assert preview.read_bytes() == b"mine" and not (tmp_path / "mask.tif").exists()
    blocker = tmp_path / "file.txt"
    blocker.write_text("a file, not a folder")
    res = seg_predict(run, image, blocker / "mask.tif", "preview=false",
                      f"hydra.run.dir={tmp_path / 'h'}", check=False)
    assert res.returncode == 2 and "file.txt' is a file, where a folder is written" in res.stderr


def test_slurm_prediction_launcher_takes_processes_and_nodes():
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    import seg_at_scale

    conf = str(Path(seg_at_scale.__file__).parent / "conf_predict")
    with initialize_config_dir(conf, version_base="1.3"):
        cfg = compose("predict", overrides=["hydra/launcher=slurm_predict", "processes=4",
                                            "nodes=3", "run=r", "image=i.tif", "output=o.zarr"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (3, 4, 4)
    assert launcher._target_.endswith("SlurmLauncher") and launcher.max_num_timeout > 0


def test_zarr_output_opens_in_xarray_with_coordinates(tmp_path, one_torch_thread):
    xr = pytest.importorskip("xarray")
    image = make_image(tmp_path / "a.tif", 97, 131)
    predict_raster(make_model(), image, tmp_path / "a.zarr",
                   PredictOptions(tile_size=64, progress=False, probabilities="uint8"),
                   class_names=CLASSES)
    ds = xr.open_zarr(tmp_path / "a.zarr", consolidated=False, mask_and_scale=False)
    labels = zarr.open_group(tmp_path / "a.zarr", mode="r")["labels"][:]
    np.testing.assert_array_equal(ds["labels"].values, labels)
    assert ds["probabilities"].dims == ("class", "y", "x") and ds.attrs["class_names"] == CLASSES
    x0, dx, _, y0, _, dy = ds.attrs["geotransform"]  # example_geotags: 500000, 4500000, 10 m
    assert (x0, dx, y0, dy) == (500000.0, 10.0, 4500000.0, -10.0)
    np.testing.assert_allclose(ds.x.values, x0 + dx * (np.arange(131) + 0.5))
    np.testing.assert_allclose(ds.y.values, y0 + dy * (np.arange(97) + 0.5))
    assert "UTM" in ds["spatial_ref"].attrs["crs_wkt"]


@pytest.mark.parametrize("fill", ["constant", "reflect"])
@pytest.mark.parametrize(("dtype", "nodata", "planar"), [
    ("uint8", None, False), ("uint16", 7, False), ("float32", None, False),
    ("uint8", None, True)])
def test_engine_inputs_are_the_bits_of_the_numpy_windows(tmp_path, fill, dtype, nodata, planar):
    """The engine reads raw windows and normalises them with torch on the model's thread:
    the same bits as the numpy windows of training, borders, no-data and per-band or
    single statistics included, in both memory layouts, one window or a batch of two, from
    interleaved and planar files."""
    from seg_at_scale.data.windows import RasterWindows
    from seg_at_scale.io import RasterReader, write_raster
    from seg_at_scale.tiling import Window
    from seg_at_scale.tiling.engine import _as_tensor
    from seg_at_scale.tiling.geometry import inside

    rng = np.random.default_rng(3)
    img = (rng.random((3, 53, 71)) * (255 if dtype == "uint8" else 4000)).astype(dtype)
    img[:, 10:14, 20:30] = 7 if nodata is not None else img[:, 10:14, 20:30]
    path = write_raster(tmp_path / "a.tif", img, tile=(16, 16), nodata=nodata, planar=planar)
    windows = [Window(-9, -13, 40, 48), Window(30, 40, 40, 48), Window(5, 12, 20, 20),
               Window(-9, 40, 71, 40)]
    for norm in (Normalizer(1 / 255, (0.5, 0.4, 0.3), (0.25, 0.2, 0.3)),
                 Normalizer(1 / 255, (0.45,), (0.27,))):
        with RasterReader(path) as reader:
            src = RasterWindows(reader, norm, fill)
            wants, raws = [], []
            for w in windows:
                want, want_bad = src.read(w)
                raw, bad = src.load(w)  # an interleaved file's window in its pixel order
                assert (raw if planar else raw.transpose(1, 2, 0)).flags.c_contiguous
                wants.append(want)
                raws.append(_as_tensor(raw)[None])
                for cl in (False, True):
                    got = src.prepare([raws[-1]], [inside(w, 53, 71)], cl)
                    assert got.dtype == torch.float32 and got.shape == (1, *want.shape)
                    assert got[0].numpy().tobytes() == np.ascontiguousarray(want).tobytes(), w
                assert (bad is None) == (want_bad is None)
                if bad is not None:
                    np.testing.assert_array_equal(bad, want_bad)
            for cl in (False, True):  # the first two windows are one size: one batch
                got = src.prepare(raws[:2], [inside(w, 53, 71) for w in windows[:2]], cl)
                assert got.numpy().tobytes() == np.stack(wants[:2]).tobytes()


def test_a_group_norm_unet_run_predicts_the_same_labels_whatever_the_tiles(tmp_path):
    """Before: a run with ``model.norm=group`` was tiled with each tile's GroupNorm
    statistics (7,052 of 60,000 labels differed between q=1 and q=3) under ``"exact": true``.
    Its GroupNorms are statistic sites now: the passes give each tile the image's."""
    from helpers.prediction import write_run

    from seg_at_scale.models import UNet

    torch.manual_seed(0)
    net = UNet(4, 5, levels=3, base_width=8, padding="same", norm="group").eval()
    head = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)][-1]
    with torch.no_grad():
        head.weight.mul_(30.0)  # spread the logits: many classes, many ties broken
    node = {"_target_": "seg_at_scale.models.UNet", "in_channels": 4, "num_classes": 5,
            "levels": 3, "base_width": 8, "padding": "same", "norm": "group"}
    data = {"bands": 4, "num_classes": 5, "class_names": CLASSES, "ignore_index": 255,
            "nodata": None, **NORM}
    run = write_run(tmp_path / "run", node, net, data, high=230.0)
    image = make_image(tmp_path / "scene.tif", 203, 171)
    labels = {}
    for q in (1, 3):
        res = _here(run, image, tmp_path / f"q{q}.tif", f"q={q}", "preview=false")
        assert res["exact"] is True and res["tiles"] == q * q
        labels[q] = read_raster(tmp_path / f"q{q}.tif")
    assert np.array_equal(labels[1], labels[3])
    assert len(np.unique(labels[1])) >= 3
    x = torch.from_numpy(NORMALIZER(read_raster(image)))[None]
    with torch.no_grad():
        whole = predict_full(net, x).argmax(1)[0].numpy()
    assert np.array_equal(labels[3][0], whole)


def test_a_gated_scnn_trained_packed_predicts_its_classes_alone(tmp_path):
    """Before: a Gated-SCNN run with ``model.output=packed`` (which its pipelines need)
    wrote the boundary channel's id K among the labels and crashed scoring them; a network
    with another channel count than its classes given to the predictor is refused."""
    from dataclasses import asdict

    from helpers.prediction import write_run

    from seg_at_scale.errors import InputError
    from seg_at_scale.models.gscnn import GSCNN, GSCNN_SIZES

    torch.manual_seed(0)
    packed = GSCNN.from_preset("tiny", in_channels=4, num_classes=5, output="packed").eval()
    seg = GSCNN.from_preset("tiny", in_channels=4, num_classes=5).eval()
    seg.load_state_dict(packed.state_dict())
    with torch.no_grad():  # the boundary channel large: packed, argmax would pick id 5
        for m in packed.modules():
            if isinstance(m, torch.nn.Conv2d) and m.out_channels == 1:
                m.bias.fill_(50.0)
    seg.load_state_dict(packed.state_dict())
    node = {"_target_": "seg_at_scale.models.GSCNN", "in_channels": 4, "num_classes": 5,
            **asdict(GSCNN_SIZES["tiny"]), "output": "packed"}
    data = {"bands": 4, "num_classes": 5, "class_names": CLASSES, "ignore_index": 255,
            "nodata": None, **NORM}
    run = write_run(tmp_path / "run", node, packed, data, fp=seg.footprint(), high=230.0)
    image = make_image(tmp_path / "scene.tif", 131, 97)
    res = _here(run, image, tmp_path / "m.tif", "q=2", "preview=false")
    labels = read_raster(tmp_path / "m.tif")[0]
    x = torch.from_numpy(NORMALIZER(read_raster(image)))[None]
    with torch.no_grad():
        assert packed(torch.zeros(1, 4, 64, 64)).shape[1] == 6
        whole = predict_full(seg, x).argmax(1)[0].numpy()
    assert labels.max() < 5 and np.array_equal(labels, whole)
    assert sum(res["class_pixels"]) == labels.size
    with pytest.raises(InputError, match=r"the network gives 6 channels per pixel for its 5 "
                                         r"classes; a prediction writes one class id per pixel"):
        predict_raster(packed, image, tmp_path / "p.tif", PredictOptions(progress=False),
                       fp=seg.footprint(), class_names=CLASSES)


def _here(run: Path, image: Path, output: Path, *overrides: str) -> dict:
    """``seg-predict`` in this process (no new Python's start-up): its result."""
    from helpers.prediction import seg_predict_here

    res = seg_predict_here(f"run={run}", f"image={image}", f"output={output}", *overrides)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout[res.stdout.index("{"):])
