"""seg-export: a portable model (safetensors + card + checksums) predicts as its run does."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import warm
from helpers.prediction import (
    env,
    make_image,
    make_model,
    make_run,
    seg_predict,
    seg_predict_here,
)

from seg_at_scale.errors import InputError, OutputExistsError
from seg_at_scale.models.segmodel import read_model, write_model
from seg_at_scale.models.trained import load_run


def seg_export(run: Path, output: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "seg_at_scale.cli.export", f"run={run}", f"output={output}",
           *overrides]
    return warm.run(cmd, capture_output=True, text=True, env=env(), timeout=120)


def seg_export_here(run: Path, output: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``seg-export`` in this process (its entry point, output and exit status)."""
    from helpers.cli import run_here

    from seg_at_scale.cli.export import main

    return run_here(main, ["seg-export", f"run={run}", f"output={output}", *overrides])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    run = make_run(tmp / "run", make_model("same", levels=3, width=8))
    out = seg_export(run, tmp / "unet.segmodel", "ckpt=last")
    assert out.returncode == 0, out.stderr
    return run, tmp / "unet.segmodel", make_image(tmp / "scene.tif", 211, 173)


def _files(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("suffix", [".tif", ".zarr"])
def test_predicting_with_the_exported_model_equals_the_run_byte_for_byte(exported, tmp_path,
                                                                          suffix):
    run, model, image = exported
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    opts = ("probabilities=uint8", "tile_size=96", "fast=false")
    res_run = seg_predict(run, image, a / f"pred{suffix}", "ckpt=last", *opts)
    cmd_model = [sys.executable, "-m", "seg_at_scale.cli.predict", f"model={model}",
                 f"image={image}", f"output={b / f'pred{suffix}'}", "progress=false", *opts]
    out = warm.run(cmd_model, capture_output=True, text=True, env=env(), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert res_run["tiles"] > 4
    files_a = {k: v for p in sorted(a.iterdir()) for k, v in _files(p).items()}
    files_b = {k: v for p in sorted(b.iterdir()) for k, v in _files(p).items()}
    assert files_a.keys() == files_b.keys() and len(files_a) >= 4
    items = [json.loads(files.pop("pred.stac.json")) for files in (files_a, files_b)]
    assert [k for k in files_a if files_a[k] != files_b[k]] == []  # every prediction byte
    # the STAC Items differ in what made them (run or model file) and when, not the data
    assert items[0]["properties"]["seg_at_scale:model"]["source"].startswith("run '")
    assert items[1]["properties"]["seg_at_scale:model"]["source"].startswith("model '")
    assert items[0]["assets"] == items[1]["assets"]


def test_ckpt_with_a_model_file_is_refused_not_ignored(exported, tmp_path):
    """``model=<file> ckpt=last`` predicted with the file's weights, ckpt silently unused."""
    from helpers.prediction import seg_predict_here

    _, model, image = exported
    out = seg_predict_here(f"model={model}", f"image={image}", f"output={tmp_path / 'a.tif'}",
                           "ckpt=last")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"seg-predict: error: ckpt='last' chooses among a training run's checkpoints, but "
        f"model='{model}' holds one set of weights; leave ckpt out, or export the checkpoint "
        "you want (seg-export run=<run> ckpt=... output=...), or predict with run=<run> "
        "ckpt=..."], out.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_the_card_describes_what_prediction_needs(exported):
    run, model, _ = exported
    with zipfile.ZipFile(model) as zf:
        assert sorted(zf.namelist()) == ["SHA256SUMS", "card.json", "weights.safetensors"]
        card = json.loads(zf.read("card.json"))
    trained = load_run(run, "last")
    assert card["model"]["family"] == "unet" and card["model"]["levels"] == 3
    assert card["footprint"] == {"halo": trained.model.footprint().halo, "align": 4,
                                 "padding": "same", "out_residue": 0}
    assert card["data"]["class_names"] == trained.class_names
    assert len(card["data"]["colours"]) == card["data"]["num_classes"] == 5
    assert card["data"]["normalization"] == {"scale": 1 / 255, "mean": [0.5], "std": [0.25]}
    assert card["training"]["checkpoint"] == "last.ckpt" and card["seg_at_scale_version"]


@pytest.mark.parametrize("part", ["weights.safetensors", "card.json"])
def test_a_flipped_byte_is_refused_naming_the_part(exported, tmp_path, part):
    run, _, _ = exported
    folder = write_model(load_run(run, "last"), tmp_path / "model")
    data = bytearray((folder / part).read_bytes())
    data[len(data) // 2] ^= 0x01
    (folder / part).write_bytes(bytes(data))
    with pytest.raises(InputError, match=rf"{part} does not match its checksum in SHA256SUMS"):
        read_model(folder)


def test_a_flipped_byte_in_a_segmodel_file_is_refused(exported, tmp_path):
    _, model, _ = exported
    with zipfile.ZipFile(model) as zf:
        parts = {n: zf.read(n) for n in zf.namelist()}
    weights = bytearray(parts["weights.safetensors"])
    weights[-5] ^= 0x10
    parts["weights.safetensors"] = bytes(weights)
    bad = tmp_path / "bad.segmodel"
    with zipfile.ZipFile(bad, "w") as zf:
        for name, data in parts.items():
            zf.writestr(name, data)
    with pytest.raises(InputError, match=r"weights.safetensors does not match its checksum"):
        read_model(bad)
    del parts["card.json"]
    with zipfile.ZipFile(bad, "w") as zf:
        for name, data in parts.items():
            zf.writestr(name, data)
    with pytest.raises(InputError, match=r"lacks card.json"):
        read_model(bad)


def test_export_refuses_to_replace_without_overwrite_or_to_write_over_the_run(exported,
                                                                              tmp_path):
    run, model, _ = exported
    with pytest.raises(OutputExistsError, match="pass overwrite=true"):
        write_model(load_run(run, "last"), model)
    out = seg_export(run, run / "checkpoints" / "last.ckpt", "ckpt=last", "overwrite=true")
    assert out.returncode == 2
    assert "is the checkpoint" in out.stderr.strip().splitlines()[-1]
    out = warm.run([sys.executable, "-m", "seg_at_scale.cli.export", f"run={run}",
                    "output=s3://bucket/unet.segmodel", "ckpt=last"], capture_output=True,
                   text=True, env=env(), timeout=120, cwd=tmp_path)
    assert out.returncode == 2
    assert "output='s3://bucket/unet.segmodel' is a URL (s3:): seg_at_scale reads and writes " \
        "local files only" in out.stderr.strip().splitlines()[-1]
    assert sorted(tmp_path.iterdir()) == []  # no 's3:' folder made where it ran


def test_the_python_path_of_the_readme_equals_the_command(exported, tmp_path):
    """The README's Python lines (load_trained + predict_scene) predict with the model's
    normalisation and footprint: the labels seg-predict model= writes. Before, the README
    pointed at predict_raster, which takes the bare network and normalises by x / 255."""
    from seg_at_scale.io import read_raster
    from seg_at_scale.models.loading import load_trained
    from seg_at_scale.prediction.options import PredictOptions
    from seg_at_scale.prediction.scene import predict_scene

    _, model, image = exported
    trained = load_trained(model=model)
    predict_scene(trained, image, tmp_path / "py.tif",
                  PredictOptions(tile_size=96, preview=False, stac=False, progress=False))
    cmd = [sys.executable, "-m", "seg_at_scale.cli.predict", f"model={model}",
           f"image={image}", f"output={tmp_path / 'cmd.tif'}", "progress=false",
           "tile_size=96", "preview=false", "stac=false"]
    out = warm.run(cmd, capture_output=True, text=True, env=env(), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert read_raster(tmp_path / "py.tif").tobytes() == read_raster(
        tmp_path / "cmd.tif").tobytes()
    from seg_at_scale.data.normalize import Normalizer

    assert trained.normalizer != Normalizer()  # not predict_raster's default, x / 255


def test_a_run_trained_with_a_smaller_halo_predicts_exactly_and_exports(tmp_path):
    """Before: a run trained with ``tiling.halo=0`` (below the network's 22) predicted with
    halo 0, tiles that disagreed with each other (q=1 and q=4 differed on 246 labels) under
    ``"exact": true``; its seg-export was then refused at load as "edited"."""

    from helpers.prediction import write_run

    from seg_at_scale.io import read_raster
    from seg_at_scale.tiling.geometry import Footprint

    net = make_model("same", levels=3, width=8)
    exact = net.footprint()
    assert exact.halo > 0
    small = Footprint(0, exact.align, exact.padding, exact.out_residue)
    from omegaconf import OmegaConf

    run = make_run(tmp_path / "ref", net)  # the data and model nodes of the helper's run
    cfg = OmegaConf.to_container(OmegaConf.load(run / "run_config.yaml"))
    assert isinstance(cfg, dict)
    run = write_run(tmp_path / "halo0", cfg["model"], net, cfg["data"], fp=small,
                    tiling={"halo": 0}, high=230.0)
    image = make_image(tmp_path / "scene.tif", 211, 173)
    outs = {}
    for q in (1, 4):
        res = _ok(seg_predict_here(f"run={run}", f"image={image}",
                                   f"output={tmp_path / f'q{q}.tif'}", f"q={q}",
                                   "preview=false"))
        assert res["halo"] == exact.halo and res["exact"] is True
        outs[q] = read_raster(tmp_path / f"q{q}.tif")
    assert outs[1].tobytes() == outs[4].tobytes()
    out = seg_export_here(run, tmp_path / "h.segmodel")
    assert out.returncode == 0, out.stderr
    res = _ok(seg_predict_here(f"model={tmp_path / 'h.segmodel'}", f"image={image}",
                               f"output={tmp_path / 'm.tif'}", "q=4", "preview=false"))
    assert res["halo"] == exact.halo
    assert read_raster(tmp_path / "m.tif").tobytes() == outs[1].tobytes()


def test_a_folder_export_is_replaced_with_overwrite_and_swapped_keys_are_named(exported,
                                                                            tmp_path):
    """Before: a folder export could not be refreshed ("is a folder; a file is written
    there"), a file of a folder's name failed on a temporary path, and model=<run folder or
    checkpoint> / run=<model> read "lacks card.json", "holds 'archive/data.pkl'", "has no
    run_config.yaml"."""
    run, model, image = exported
    folder = tmp_path / "unet_folder"
    assert seg_export_here(run, folder, "ckpt=last").returncode == 0
    again = seg_export_here(run, folder, "ckpt=last")
    assert again.returncode == 2 and again.stderr.strip().splitlines()[-1].endswith(
        f"output '{folder}' is a model seg-export wrote; pass overwrite=true to replace it (or "
        "choose another path)")
    assert seg_export_here(run, folder, "ckpt=last", "overwrite=true").returncode == 0
    assert read_model(folder).card.raw == read_model(model).card.raw
    (tmp_path / "other").mkdir()
    (tmp_path / "notes").write_text("mine\n")
    for path, said in ((tmp_path / "other", "is a folder seg-export did not write; choose "
                                            "another path (overwrite=true replaces only a "
                                            "model seg-export wrote)"),
                       (tmp_path / "notes", "is a file, and seg-export writes a folder for a "
                                            "name without .segmodel")):
        out = seg_export_here(run, path, "ckpt=last", "overwrite=true")
        assert out.returncode == 2 and said in out.stderr.strip().splitlines()[-1]
    assert (tmp_path / "notes").read_text() == "mine\n"
    with pytest.raises(InputError, match=rf"model='{run}' is not a model made by seg-export: "
                                         rf"it is the training run '{run}': give run={run}$"):
        read_model(run)
    ckpt = run / "checkpoints" / "last.ckpt"
    with pytest.raises(InputError, match=rf"it is a checkpoint of the run '{run}': give "
                                         rf"run={run} ckpt=last.ckpt$"):
        read_model(ckpt)
    with pytest.raises(InputError, match=rf"it is a model seg-export wrote: give model={model}"):
        load_run(model)


def _ok(res: subprocess.CompletedProcess) -> dict:
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout[res.stdout.index("{"):])
