"""seg-predict refuses bad input before any work, in one line, and loses nothing.

Each case here was found by trying ~70 bad inputs as a new user would; before, it replaced
the ground truth, predicted wrong labels with exit 0, crashed after the whole prediction,
or printed a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import warm
from helpers.prediction import seg_predict_here
from omegaconf import OmegaConf

from seg_at_scale.io import example_geotags, read_raster, write_raster
from seg_at_scale.tiling.geometry import Footprint


def seg_predict(run: Path, image: Path, output: Path, *overrides: str, check: bool = True,
                timeout: int = 0, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``seg-predict`` in this process (the console script's entry point, exit status and
    output): these cases run in a fraction of a new Python's start-up time."""
    res = seg_predict_here(f"run={run}", f"image={image}", f"output={output}", *overrides,
                           cwd=cwd)
    if check:
        assert res.returncode == 0, res.stderr[-2000:]
    return res


def _one_line(out: subprocess.CompletedProcess, *expected: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("seg-predict: error: "), lines[0]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def _nothing_written(folder: Path, *keep: str) -> None:
    assert sorted(p.name for p in folder.iterdir() if p.name not in keep) == []


@pytest.fixture()
def truth(cli_case, tmp_path) -> Path:
    """A valid ground truth of the cli_case image (labels 0..4)."""
    _, image = cli_case
    labels = (read_raster(image)[0] // 52).astype(np.uint8)
    return write_raster(tmp_path / "gt.tif", labels, tile=(64, 64))


@pytest.mark.parametrize("how", ["same", "dot", "symlink", "hardlink"])
def test_an_output_that_is_the_mask_is_refused_and_the_truth_survives(cli_case, truth,
                                                                      tmp_path, how):
    """Before: output=gt.tif mask=gt.tif overwrite=true replaced the truth, mIoU 1.0."""
    run, image = cli_case
    before = truth.read_bytes()
    out = {"same": truth, "dot": Path("./gt.tif"), "symlink": tmp_path / "link.tif",
           "hardlink": tmp_path / "hard.tif"}[how]
    if how == "symlink":
        out.symlink_to(truth)
    if how == "hardlink":
        os.link(truth, out)
    res = seg_predict(run, image, out, f"mask={truth}", "overwrite=true", check=False,
                      cwd=tmp_path)
    _one_line(res, "is the mask", str(truth))
    assert truth.read_bytes() == before
    assert not list(tmp_path.glob(".*.zarr")) and not list(tmp_path.glob("*_preview.png"))


def test_an_input_inside_a_zarr_output_folder_is_refused(cli_case, tmp_path):
    run, image = cli_case
    folder = tmp_path / "out.zarr"
    folder.mkdir()
    inner = folder / "scene.tif"
    inner.write_bytes(image.read_bytes())
    res = seg_predict(run, inner, folder, "overwrite=true", check=False)
    _one_line(res, "(or holds it)")
    assert inner.read_bytes() == image.read_bytes()


@pytest.mark.parametrize(("dtype", "scale"), [("uint16", 257), ("float32", 1 / 255),
                                              ("float64", 1 / 255), ("int8", 0.5)])
def test_an_image_of_another_sample_type_is_refused(cli_case, tmp_path, dtype, scale):
    """Before: uint16 / float / int8 images through a uint8-trained run changed 28-78 % of
    the labels, exit 0. The same pixels in another type are refused with the fix."""
    run, image = cli_case
    pixels = (read_raster(image).astype(np.float64) * scale).astype(dtype)
    other = write_raster(tmp_path / f"{dtype}.tif", pixels, tile=(64, 64),
                         geotags=example_geotags())
    res = seg_predict(run, other, tmp_path / "out" / "m.tif", check=False)
    _one_line(res, f"has {dtype} samples but run", "trained on uint8 imagery",
              "check_dtype=false")
    assert not (tmp_path / "out" / "m.tif").exists()


@pytest.mark.parametrize("dtype", ["bool", "complex64"])
def test_an_image_no_model_reads_is_refused(cli_case, tmp_path, dtype):
    run, image = cli_case
    other = write_raster(tmp_path / "odd.tif", read_raster(image).astype(dtype), tile=(64, 64))
    res = seg_predict(run, other, tmp_path / "m.tif", "check_dtype=false", check=False)
    _one_line(res, f"has {dtype} samples, which no model reads")


def test_check_dtype_false_predicts_an_image_the_user_vouches_for(cli_case, tmp_path):
    run, image = cli_case
    same = write_raster(tmp_path / "u16.tif", read_raster(image).astype(np.uint16),
                        tile=(64, 64), geotags=example_geotags())
    res = seg_predict(run, same, tmp_path / "a.tif", "check_dtype=false", "preview=false",
                      "tile_size=256")
    ref = seg_predict(run, image, tmp_path / "b.tif", "preview=false", "tile_size=256")
    assert json.loads(res.stdout)["tiles"] == json.loads(ref.stdout)["tiles"] > 1
    assert read_raster(tmp_path / "a.tif").tobytes() == read_raster(tmp_path / "b.tif").tobytes()


def test_a_float_image_far_off_the_training_range_is_refused(tmp_path):
    from helpers.prediction import make_model, make_run

    run = make_run(tmp_path / "run", make_model("same", levels=3, width=8))
    cfg = OmegaConf.load(run / "run_config.yaml")
    cfg.computed.input = {"dtype": "float32", "high": 1.0}  # trained on reflectance 0..1
    OmegaConf.save(cfg, run / "run_config.yaml")
    rng = np.random.default_rng(0)
    dn = write_raster(tmp_path / "dn.tif", (rng.random((4, 90, 70)) * 10000).astype(np.float32),
                      tile=(64, 64))  # the same sensor's digital numbers
    res = seg_predict(run, dn, tmp_path / "m.tif", "ckpt=last", check=False)
    _one_line(res, "reaches about", "trained on float32 imagery reaching about 1")


@pytest.mark.parametrize(("setup", "expected"), [
    ("label9", "has label 9 at row 200, col 300, but the model predicts 5 classes (valid "
               "labels 0..4, 255 = ignore; 1 pixels carry it); give the truth of this "
               "model's classes, or drop mask="),  # not "raise data.num_classes": no such key
    ("bands4", "has 4 bands; masks are single-band"),
    ("folder", "is a folder; a file is written there"),
    ("nodata300", "nodata=300 cannot occur in image"),
])
def test_bad_input_found_after_the_work_before_is_refused_before(cli_case, truth, tmp_path,
                                                                  setup, expected):
    """Before: the whole prediction ran, then `cannot reshape` or `IsADirectoryError`."""
    run, image = cli_case
    out, extra = tmp_path / "out" / "m.tif", []
    if setup == "label9":
        labels = read_raster(truth)[0]
        labels[200, 300] = 9
        extra = [f"mask={write_raster(tmp_path / 'bad.tif', labels, overwrite=True)}"]
    elif setup == "bands4":
        extra = [f"mask={write_raster(tmp_path / 'bad.tif', read_raster(image))}"]
    elif setup == "folder":
        out.mkdir(parents=True)
        (out / "keep.txt").write_text("mine")
        extra = ["overwrite=true"]
    else:
        extra = ["nodata=300"]
    res = seg_predict(run, image, out, *extra, check=False)
    _one_line(res, expected)
    if setup == "folder":
        assert (out / "keep.txt").read_text() == "mine"
    else:
        assert not out.parent.exists() or sorted(out.parent.iterdir()) == []


@pytest.mark.parametrize(("overrides", "expected"), [
    (["nodata=abc"], "nodata='abc' is not a number or null"),
    (["q=abc"], "q='abc' is not a whole number or a list of 2 (a whole number) or null"),
    (["q=2.5"], "q=2.5 is not a whole number"),
    (["q=0"], "q=0: give tiles per side as a whole number >= 1"),
    (["tile_size=abc"], "tile_size='abc' is not a whole number"),
    (["batch_size=abc"], "batch_size='abc' is not a whole number"),
    (["batch_size=-3"], "batch_size=-3: give tiles per forward pass"),
    (["batch_size=0"], "batch_size=0: give tiles per forward pass"),
    (["tta=foo"], "tta='foo' is not one of 'flips', 'd4' or null"),
    (["tta=true"], "tta=True is not one of 'flips', 'd4' or null"),
    (["fast=maybe"], "fast='maybe' is not true or false"),
    (["keep_store=maybe"], "keep_store='maybe' is not true or false"),
    (["device=tpu"], "device='tpu': use auto, cpu, cuda or cuda:<index>"),
    (["nodes=2"], "nodes=2 but this is not a SLURM job or a torchrun launch"),
    (["processes=8", "q=1"], "processes=8 but the grid of"),
    (["imgae=x.tif"], "imgae= is not a seg-predict key (did you mean image=?)"),
    (["image=/tmp/scans (1)/a.tif"], "must be quoted for Hydra"),
])
def test_bad_values_are_one_line_and_exit_2(cli_case, tmp_path, overrides, expected):
    run, image = cli_case
    res = seg_predict(run, image, tmp_path / "m.tif", *overrides, check=False, timeout=120)
    _one_line(res, expected)
    assert not (tmp_path / "m.tif").exists() and not (tmp_path / ".m.tif.zarr").exists()


@pytest.mark.parametrize(("override", "expected"), [
    ("image=s3://bucket/scene.tif", "image='s3://bucket/scene.tif' is a URL (s3:): "
     "seg_at_scale reads and writes local files only"),
    ("image=/vsizip//data/scenes.zip/a.tif", "image='/vsizip//data/scenes.zip/a.tif' is a GDAL "
     "virtual path"),
    ("mask=https://example.org/truth.tif", "mask='https://example.org/truth.tif' is a URL "
     "(https:)"),
    ("output=gs://bucket/m.tif", "output='gs://bucket/m.tif' is a URL (gs:): seg_at_scale"),
    ("hydra.run.dir=s3://bucket/logs", "hydra.run.dir='s3://bucket/logs' is a URL (s3:): "
     "seg_at_scale"),
])
def test_a_url_or_a_gdal_virtual_path_is_refused_with_the_fix(cli_case, tmp_path, override,
                                                              expected):
    run, image = cli_case
    keys = {"image": f"image={image}", "output": f"output={tmp_path / 'm.tif'}"}
    keys[override.split("=", 1)[0]] = override
    res = seg_predict_here(f"run={run}", *keys.values(), cwd=tmp_path)
    line = _one_line(res, expected)
    written = override.startswith(("output=", "hydra."))
    assert ("then copy the result there" in line) == written
    assert ("copy it to a local or mounted folder first" in line) != written
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written, even here


@pytest.mark.parametrize("missing", ["run", "image"])
def test_a_missing_key_is_named(cli_case, tmp_path, missing):
    run, image = cli_case
    keys = {"run": f"run={run}", "image": f"image={image}"}
    del keys[missing]
    res = seg_predict_here(*keys.values(), f"output={tmp_path / 'm.tif'}")
    _one_line(res, "run=<training run folder> or model=" if missing == "run" else "image= is "
              "missing")


def _broken_run(cli_case, tmp_path, how: str) -> Path:
    import shutil

    run, _ = cli_case
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ckpt, cfg_path = copy / "checkpoints" / "last.ckpt", copy / "run_config.yaml"
    if how in ("truncated", "empty", "text"):
        data = ckpt.read_bytes()
        ckpt.write_bytes({"truncated": data[: len(data) // 3], "empty": b"",
                          "text": b"hello"}[how])
    elif how in ("widths", "classes", "bands", "std0"):
        cfg = OmegaConf.load(cfg_path)
        if how == "widths":
            cfg.model.base_width = 16
        elif how == "classes":
            cfg.model.num_classes = cfg.data.num_classes = 6
            cfg.data.class_names = [*cfg.data.class_names, "extra"]
        elif how == "bands":
            cfg.model.in_channels = 3
        else:
            cfg.data.std = [0.25, 0.0, 0.25, 0.25]
        OmegaConf.save(cfg, cfg_path)
    else:
        cfg_path.write_text({"bad_yaml": "model: [unclosed\n", "empty_yaml": ""}[how])
    return copy


@pytest.mark.parametrize(("how", "expected"), [
    ("truncated", "last.ckpt' cannot be read"),
    ("empty", "last.ckpt' is empty (0 bytes)"),
    ("text", "last.ckpt' cannot be read"),
    ("widths", "the weights do not fit the model its config describes"),
    ("classes", "the weights do not fit the model"),
    ("bands", "the weights do not fit the model"),
    ("std0", "the normalisation has std 0.0 for band 1"),
    ("bad_yaml", "run_config.yaml' is not readable YAML"),
    ("empty_yaml", "run_config.yaml' holds no model and data sections"),
])
def test_a_damaged_run_folder_is_one_line(cli_case, tmp_path, how, expected):
    _, image = cli_case
    run = _broken_run(cli_case, tmp_path, how)
    res = seg_predict(run, image, tmp_path / "m.tif", "ckpt=last", check=False)
    _one_line(res, expected)
    assert not (tmp_path / "m.tif").exists()


def test_a_zarr_output_that_is_a_plain_file_is_refused(cli_case, tmp_path):
    run, image = cli_case
    plain = tmp_path / "x.zarr"
    plain.write_text("mine")
    _one_line(seg_predict(run, image, plain, "overwrite=true", check=False),
              "is a plain file, not a Zarr store")
    assert plain.read_text() == "mine"


def test_an_empty_image_is_named(cli_case, tmp_path):
    import tifffile

    run, _ = cli_case
    empty = tmp_path / "empty.tif"
    with pytest.warns(UserWarning):
        tifffile.imwrite(empty, np.zeros((0, 0), np.uint8))
    _one_line(seg_predict(run, empty, tmp_path / "m.tif", check=False),
              "is 0x0 pixels: there is nothing to predict")


def test_a_prediction_leaves_only_its_outputs(cli_case, tmp_path):
    """Before: a `.NAME.lock` beside every output and `runs/predict/<date>/` in the cwd."""
    run, image = cli_case
    for name in ("scene.v1.tif", "scene.v2.tif"):
        seg_predict(run, image, Path(name), "tile_size=256", cwd=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "scene.v1.stac.json", "scene.v1.tif", "scene.v1_preview.png",
        "scene.v2.stac.json", "scene.v2.tif", "scene.v2_preview.png"]


def test_help_speaks_prediction():
    """Before: --help listed the training groups (data, experiment, model_family, ...)."""
    res = warm.run([sys.executable, "-m", "seg_at_scale.cli.predict", "--help"],
                   capture_output=True, text=True, timeout=120)
    assert res.returncode == 0
    for key in ("run=", "model=", "image=", "images=", "output_dir=", "vector=", "on_error=",
                "processes=", "nodes=", "trust_run="):
        assert f"\n  {key}" in res.stdout, key
    assert "model_family" not in res.stdout and "experiment" not in res.stdout
    assert "sbatch" in res.stdout and "vector=a_buildings.gpkg" in res.stdout


def test_a_checkpoint_or_the_checkpoints_folder_as_run_names_the_run_to_give(cli_case,
                                                                             tmp_path):
    """run= a checkpoint file or the run's checkpoints/ folder said only "has no
    run_config.yaml"; ckpt= a checkpoint's name (as the run's folder lists it) was "no
    checkpoint". Now the refusal names the command to give, and the name is the run's own."""
    run, image = cli_case
    ckpt = run / "checkpoints" / "last.ckpt"
    _one_line(seg_predict(ckpt, image, tmp_path / "a.tif", check=False),
              f"it is a checkpoint of the run '{run}': give run={run} ckpt=last.ckpt")
    _one_line(seg_predict(run / "checkpoints", image, tmp_path / "a.tif", check=False),
              f"it is inside the run '{run}': give run={run}")
    _one_line(seg_predict(run, image, tmp_path / "a.tif", "ckpt=epoch9.ckpt", check=False),
              f"ckpt='epoch9.ckpt': no checkpoint at 'epoch9.ckpt'; use ckpt=last, ckpt=best, "
              f"the name of one in '{run / 'checkpoints'}' (the run holds last.ckpt)")
    _nothing_written(tmp_path)
    res = seg_predict(run, image, tmp_path / "a.tif", "ckpt=last.ckpt", "tile_size=128")
    assert json.loads(res.stdout)["checkpoint"] == str(ckpt)


@pytest.mark.parametrize("output", [".", "/", "..", "mine/..", "labels"])
def test_an_output_that_names_a_folder_or_no_format_is_one_line(cli_case, tmp_path, output):
    """Before: ``output=.`` and ``output=/`` ended in a traceback ("PosixPath('.') has an
    empty name") where the output's lock is named, exit status 1."""
    run, image = cli_case
    (tmp_path / "mine").mkdir()
    res = seg_predict_here(f"run={run}", f"image={image}", f"output={output}", cwd=tmp_path)
    _one_line(res, f"output='{Path(output)}': the extension '(none)' names no format this "
              "writes; use .tif (Cloud-Optimized GeoTIFF) or .zarr (Zarr v3)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_a_polygon_file_in_a_folder_that_cannot_be_written_is_refused_before_work(
        cli_case, tmp_path, monkeypatch):
    """Before: ``vector=<read-only folder>/v.gpkg`` ended the run after the labels and the
    preview were written, in a message naming training paths (SEG_DATA_DIR, data.root)."""
    run, image = cli_case
    locked = tmp_path / "ro"
    locked.mkdir()
    real = os.access

    def access(path, mode, *args, **kwargs):  # the folder as a read-only mount shows it
        if Path(path) == locked and mode & os.W_OK:
            return False
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    out = tmp_path / "o" / "m.tif"
    for vector in (locked / "v.gpkg", locked / "deeper" / "v.gpkg"):
        res = seg_predict(run, image, out, f"vector={vector}", check=False)
        _one_line(res, f"vector='{vector}': the folder '{locked}' is not writable; choose a "
                  "writable location")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ro"]


@pytest.mark.parametrize(("args", "expected"), [
    (["RUN", "scene.tif", "o/pos.tif"], "'scene.tif' is not key=value; arguments are "
     "key=value, as in 'seg-predict run=<run folder> image=scene.tif output=labels.tif' "
     "(see seg-predict --help)"),
    (["--run", "r1", "--image", "scene.tif"], "'--run' is not a flag of seg-predict: give "
     "run=r1 (arguments are key=value; see seg-predict --help)"),
    (["RUN", "image=scene.tif", "--output", "o/x.tif"], "'--output' is not a flag of "
     "seg-predict: give output=o/x.tif (arguments are key=value; see seg-predict --help)"),
    (["RUN", "image=scene.tif", "--output=o/x.tif"], "'--output=o/x.tif' is not a flag of "
     "seg-predict: give output=o/x.tif"),
    (["help"], "'help' is not key=value; arguments are key=value"),
    (["RUN", "--frobnicate"], "'--frobnicate' is not a flag of seg-predict; arguments are "
     "key=value"),
])
def test_an_argument_that_is_not_key_value_is_told_the_form(cli_case, tmp_path, args,
                                                             expected):
    """Before: ``seg-predict run=r scene.tif`` was advised to quote it as "scene.tif=''",
    ``--run r`` was read as Hydra's own flag and ``r`` as an override, and ``--version``
    printed only Hydra's version."""
    run, _ = cli_case
    res = seg_predict_here(*(f"run={run}" if a == "RUN" else a for a in args), cwd=tmp_path)
    _one_line(res, expected)
    assert sorted(tmp_path.iterdir()) == []


def test_version_names_the_project():
    from seg_at_scale import __version__

    res = seg_predict_here("--version")
    assert res.returncode == 0 and res.stdout.strip().startswith(
        f"seg-predict (seg_at_scale) {__version__}, Hydra "), res.stdout


def test_more_processes_than_any_grid_of_the_image_has_batches_is_refused_before_ranks(
        cli_case, tmp_path):
    """Before: with tile_size=auto the check ran in the ranks, after Lightning's banner,
    and advised "a smaller tile_size" for a 20 x 30 image no tile can cut ("1 batches")."""
    run, image = cli_case
    small = tmp_path / "small.tif"
    write_raster(small, read_raster(image)[:, :20, :30])
    res = seg_predict(run, small, tmp_path / "o" / "m.tif", "processes=3", check=False)
    _one_line(res, f"processes=3 but no grid of '{small}' has more than 1 batch of tiles for "
              "this model (its smallest tiles); use processes <= 1")
    res = seg_predict(run, small, tmp_path / "o" / "m.tif", "processes=2", "q=1", check=False)
    _one_line(res, f"processes=2 but the grid of '{small}' has only 1 batch of tiles (1 "
              "tile); use processes <= 1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.tif"]


def test_a_checkpoint_of_another_run_is_named_as_such(cli_case, tmp_path):
    """Before: ``ckpt=<another run's checkpoint>`` was put down to an edited config
    ("restore it"), which the user had not touched."""
    from helpers.prediction import make_model, make_run

    run, image = cli_case
    other = make_run(tmp_path / "other", make_model("same", levels=3, width=4))
    res = seg_predict(run, image, tmp_path / "m.tif",
                      f"ckpt={other / 'checkpoints' / 'last.ckpt'}", check=False)
    line = _one_line(res, "the weights do not fit the model its config describes")
    assert line.endswith("The checkpoint is another run's (predict it with run=<that run's "
                         "folder>, or give one of this run's checkpoints), or the config was "
                         "edited (restore it)")
    assert not (tmp_path / "m.tif").exists()


def test_polygon_classes_the_model_does_not_predict_are_refused(cli_case, tmp_path):
    """Before: ``vector_classes=[9]`` with a 5-class model wrote an empty GeoPackage."""
    run, image = cli_case
    res = seg_predict(run, image, tmp_path / "m.tif", f"vector={tmp_path / 'm.gpkg'}",
                      "vector_classes=[1,9]", check=False)
    line = _one_line(res, "vector_classes=[1, 9] holds [9], but run '")
    assert line.endswith("predicts classes 0..4 (background, vegetation, water, road, "
                         "building); give ids among them"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("extra, said", [
    (("vector_connectivity=8",), "vector_connectivity=8 is for polygons, and no vector= was "
     "given: add vector=<name>.gpkg (.parquet, .fgb; an archive: vector=gpkg), or leave "
     "vector_connectivity out"),
    (("vector_classes=[7]",), "vector_classes=[7] is for polygons, and no vector= was given"),
    (("vector=m.gpkg", "vector_classes=[-1]"),
     "vector_classes=[-1] holds [-1]: give class ids 0..254 (255 is no data)"),
])
def test_polygon_keys_without_polygons_or_out_of_range_are_refused(cli_case, tmp_path, extra,
                                                                    said):
    """Before: the first two ran with exit 0 and drew no polygons; the third named a key
    ``classes`` that seg-predict does not have."""
    run, image = cli_case
    extra = tuple(e.replace("m.gpkg", str(tmp_path / "m.gpkg")) for e in extra)
    res = seg_predict(run, image, tmp_path / "m.tif", *extra, check=False)
    assert _one_line(res).startswith(f"seg-predict: error: {said}")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_archive_folder_that_is_missing_or_holds_other_rasters_is_told_so(cli_case,
                                                                            tmp_path):
    """Before: both read "names no rasters", and a folder of .img files gave no hint."""
    run, _ = cli_case
    res = seg_predict_here(f"run={run}", f"images={tmp_path / 'nope'}",
                           f"output_dir={tmp_path / 'out'}")
    _one_line(res, f"images='{tmp_path / 'nope'}' does not exist; give a folder of .tif files")
    (tmp_path / "erdas").mkdir()
    (tmp_path / "erdas" / "a.img").write_bytes(b"")
    res = seg_predict_here(f"run={run}", f"images={tmp_path / 'erdas'}",
                           f"output_dir={tmp_path / 'out'}")
    _one_line(res, f"images='{tmp_path / 'erdas'}' names no rasters (it holds .img files: "
              f"give them as a glob, e.g. images='{tmp_path / 'erdas' / '*.img'}')")


def test_a_vector_format_alone_for_one_scene_is_told_to_name_a_file(cli_case, tmp_path):
    """Before: ``vector=gpkg`` with image= read "unknown vector extension ''"."""
    run, image = cli_case
    res = seg_predict(run, image, tmp_path / "m.tif", "vector=gpkg", check=False)
    _one_line(res, "vector 'gpkg': unknown vector extension '' (a file name: "
              "vector=<name>.gpkg; the format alone is for images=)")


@pytest.mark.parametrize(("override", "expected"), [
    ("output_format=zarr", "output_format=zarr is for images= (an archive); with image= the "
     "output's extension chooses (.tif or .zarr)"),
    ("on_error=skip", "on_error=skip is for images= (an archive); with image= a bad scene is "
     "refused"),
    ("vector_merge=true", "vector_merge=True is for images= (an archive)"),
])
def test_an_archive_key_with_one_scene_is_refused_not_ignored(cli_case, tmp_path, override,
                                                              expected):
    """Before: ``image=a.tif output=a.tif output_format=zarr`` wrote a COG, silently."""
    run, image = cli_case
    res = seg_predict(run, image, tmp_path / "m.tif", override, check=False)
    _one_line(res, expected)
    assert sorted(tmp_path.iterdir()) == []


def test_an_image_that_is_a_device_is_not_called_a_folder(cli_case, tmp_path):
    run, _ = cli_case
    res = seg_predict(run, Path("/dev/null"), tmp_path / "m.tif", check=False)
    _one_line(res, "image='/dev/null' is not a file (a device or a pipe); give the path of a "
              "raster file")


def test_an_archive_output_folder_that_cannot_be_written_is_named_as_output_dir(
        cli_case, tmp_path, monkeypatch):
    """Before: "output='ro/archive': the folder 'ro' is not writable" (archive: the name of
    the archive's own lock)."""
    run, image = cli_case
    locked = tmp_path / "ro"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: False if Path(p) == locked
                        and mode & os.W_OK else real(p, mode, *a, **k))
    res = seg_predict_here(f"run={run}", f"images={image}", f"output_dir={locked}")
    _one_line(res, f"output_dir '{locked}': the folder '{locked}' is not writable; choose a "
              "writable location")


def test_a_network_of_detector_planes_is_refused_before_it_writes_mixed_labels(tmp_path):
    """Before: a UResNet run (3 planes x 3 classes) wrote plane-and-class ids 0..8 into a
    3-class label COG and exited 0 (``class_pixels`` counted 3 of its 9 ids)."""
    from helpers.prediction import make_planes_run

    run, _ = make_planes_run(tmp_path / "run")
    image = write_raster(tmp_path / "event.tif",
                         np.random.default_rng(0).random((3, 75, 131)).astype(np.float32))
    res = seg_predict(run, image, tmp_path / "labels.tif", "check_dtype=false", check=False)
    line = _one_line(res, f"run '{run}' labels 3 detector planes apart (3 classes each, 9 "
                          "logit channels), and seg-predict writes one label per pixel")
    assert line.endswith("plane_view(logits, 3).argmax(1) (docs/models.md)")
    _nothing_written(tmp_path, "run", "event.tif")


def test_an_output_dir_that_is_a_file_is_named_as_a_file(cli_case, tmp_path):
    """Before: "cannot create its folder ([Errno 17] File exists ...); choose a writable
    location" for a path that is a file, not an unwritable place."""
    run, image = cli_case
    (tmp_path / "scenes").mkdir()
    (tmp_path / "scenes" / "a.tif").write_bytes(image.read_bytes())
    (tmp_path / "afile").write_text("mine\n")
    res = seg_predict_here(f"run={run}", f"images={tmp_path / 'scenes'}",
                           f"output_dir={tmp_path / 'afile'}")
    line = _one_line(res)
    assert line.endswith(f"'{tmp_path / 'afile'}' is a file, where a folder is written; choose "
                         "another path"), line
    assert (tmp_path / "afile").read_text() == "mine\n"


@pytest.mark.parametrize("fp", [Footprint(22, 8, "same", 0), Footprint(3, 4, "same", 0),
                                Footprint(92, 16, "valid", 4), Footprint(5, 2, "valid", 1)],
                         ids=str)
def test_the_most_batches_of_an_image_are_counted_without_making_its_grid(fp, monkeypatch):
    """Before: the count made the grid of the smallest tiles for every seg-predict with
    tile_size=auto: a near-free U-Net (halo 3) on an 8192^2 scene spent minutes and 12 GB
    making millions of tiles before any work. The count equals the grid's batches."""
    from seg_at_scale.prediction import checks
    from seg_at_scale.tiling import make_grid
    from seg_at_scale.tiling.engine import plan_batches
    from seg_at_scale.tiling.tile_sides import smallest_side

    for h, w in [(1, 1), (37, 211), (301, 233), (517, 95)]:
        tiles = make_grid(h, w, fp, tile_size=smallest_side(fp), uniform=True).tiles
        for batch in (None, 1, 3, 7, 64):
            assert checks.most_batches(h, w, fp, batch) == len(plan_batches(tiles, batch or 1))

    def no_grid(*_a, **_k):
        raise AssertionError("made a grid")

    monkeypatch.setattr(checks, "make_grid", no_grid)
    monkeypatch.setattr(checks, "plan_batches", no_grid)
    most = checks.most_batches(50_003, 49_999, Footprint(3, 4, "same", 0), 16)
    side = smallest_side(Footprint(3, 4, "same", 0))
    assert most >= (50_003 // side) * (49_999 // side) // 16  # millions of tiles, counted
