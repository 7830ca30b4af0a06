"""An archive runs its scenes as one stream of batches and finalises a scene (its COG,
overviews, companions) on a background thread while the network already runs the next
scene; the outputs stay those of one run per scene."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from helpers.prediction import make_model, make_run, seg_predict_here

from seg_at_scale.io import read_raster, write_raster
from seg_at_scale.prediction import archive, raster

SIZES = {"a": (97, 131), "b": (64, 60), "c": (120, 91)}
OPTS = ("ckpt=last", "tile_size=96", "preview=false", "stac=false")


def test_a_scene_is_finalised_while_the_next_one_runs(tmp_path, monkeypatch):
    run = make_run(tmp_path / "run", make_model("same", levels=3, width=8))
    rng = np.random.default_rng(0)
    (tmp_path / "scenes").mkdir()
    for stem, (h, w) in SIZES.items():
        write_raster(tmp_path / "scenes" / f"{stem}.tif",
                     rng.integers(0, 255, (4, h, w), dtype=np.uint8), tile=(32, 32))
        res = seg_predict_here(f"run={run}", f"image={tmp_path / 'scenes' / f'{stem}.tif'}",
                               f"output={tmp_path / 'single' / f'{stem}.tif'}", *OPTS)
        assert res.returncode == 0, res.stderr

    streams, second_written, seen = [], threading.Event(), []
    predict_scenes, finalize, write = archive.predict_scenes, archive.finalize, raster._write

    def counting(model, works, *args, **kwargs):
        streams.append((threading.current_thread().name, len(works)))
        return predict_scenes(model, works, *args, **kwargs)

    def writing(store, batch, outputs):
        write(store, batch, outputs)
        if store.path.name == ".b.tif.zarr":
            second_written.set()

    def waiting(store, out, *args, **kwargs):
        if out.stem == "a":  # the first scene's finalisation waits for the second's tiles
            seen.append((threading.current_thread().name, second_written.wait(30)))
        return finalize(store, out, *args, **kwargs)

    monkeypatch.setattr(archive, "predict_scenes", counting)
    monkeypatch.setattr(archive, "finalize", waiting)
    monkeypatch.setattr(raster, "_write", writing)
    res = seg_predict_here(f"run={run}", f"images={tmp_path / 'scenes'}",
                           f"output_dir={tmp_path / 'many'}", *OPTS)
    assert res.returncode == 0, res.stderr
    assert streams == [(threading.current_thread().name, 3)]  # one stream of every scene
    assert len(seen) == 1 and seen[0][0].startswith("finish") and seen[0][1], seen
    for stem in SIZES:
        assert np.array_equal(read_raster(tmp_path / "many" / f"{stem}.tif"),
                              read_raster(tmp_path / "single" / f"{stem}.tif")), stem


def test_an_archive_asks_the_network_its_channels_once_not_once_per_scene(tmp_path):
    """``tile_size=auto`` checks each scene's bands on the network's smallest window before
    measuring; an archive of thousands of scenes ran that forward once per scene (a wide
    encoder on a CPU: seconds each). Asked once per network, device and bands; a scene of
    other bands is still refused."""
    from seg_at_scale.errors import InputError
    from seg_at_scale.models.loading import load_trained
    from seg_at_scale.prediction.archive import archive_scenes, predict_archive
    from seg_at_scale.prediction.options import PredictOptions
    from seg_at_scale.prediction.plan import output_channels
    from seg_at_scale.tiling.tile_sides import smallest_side

    trained = load_trained(make_run(tmp_path / "run", make_model("same", levels=3, width=8)),
                           ckpt="last")
    side = smallest_side(trained.footprint)
    probes = []
    trained.model.register_forward_pre_hook(
        lambda m, args: probes.append(args[0].shape[1]) if args[0].shape[-2:] == (side, side)
        and not args[0].any() else None)
    rng = np.random.default_rng(1)
    (tmp_path / "in").mkdir()
    for stem, (h, w) in SIZES.items():
        write_raster(tmp_path / "in" / f"{stem}.tif",
                     rng.integers(0, 255, (4, h, w), dtype=np.uint8), tile=(32, 32))
    scenes = archive_scenes(str(tmp_path / "in" / "*.tif"), tmp_path / "out")
    records = predict_archive(trained, scenes, PredictOptions(
        preview=False, stac=False, progress=False, layout="contiguous", compile=False))
    assert [r.status for r in records] == ["done"] * len(SIZES)
    assert probes == [4]
    with pytest.raises(InputError, match="cannot run on the image's 3 bands"):
        output_channels(trained.model, 3, trained.footprint)
    with pytest.raises(InputError, match="cannot run on the image's 3 bands"):
        output_channels(trained.model, 3, trained.footprint)  # refused again, not cached
    assert output_channels(trained.model, 4, trained.footprint) == 5 and probes == [4, 3, 3]
    trained.model.head = torch.nn.Conv2d(8, 2, 1)  # a head replaced in place: asked again
    assert output_channels(trained.model, 4, trained.footprint) == 2 and probes == [4, 3, 3, 4]
