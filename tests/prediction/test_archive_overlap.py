"""An archive finalises a scene (its COG, overviews, companions) on a background thread
while the network already runs the next scene, and the outputs stay those of one run per
scene."""

from __future__ import annotations

import threading

import numpy as np
from helpers.prediction import make_model, make_run, seg_predict_here

from seg_at_scale.io import read_raster, write_raster
from seg_at_scale.prediction import archive

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

    runs, second_started, seen = [], threading.Event(), []
    predict_batches, finalize = archive.predict_batches, archive.finalize

    def counting(*args, **kwargs):
        runs.append(threading.current_thread().name)
        if len(runs) == 2:
            second_started.set()
        return predict_batches(*args, **kwargs)

    def waiting(store, out, *args, **kwargs):
        if out.stem == "a":  # the first scene's finalisation waits for the second's tiles
            seen.append((threading.current_thread().name, second_started.wait(30)))
        return finalize(store, out, *args, **kwargs)

    monkeypatch.setattr(archive, "predict_batches", counting)
    monkeypatch.setattr(archive, "finalize", waiting)
    res = seg_predict_here(f"run={run}", f"images={tmp_path / 'scenes'}",
                           f"output_dir={tmp_path / 'many'}", *OPTS)
    assert res.returncode == 0, res.stderr
    assert len(runs) == 3 and all(not name.startswith("finish") for name in runs)
    assert len(seen) == 1 and seen[0][0].startswith("finish") and seen[0][1], seen
    for stem in SIZES:
        assert np.array_equal(read_raster(tmp_path / "many" / f"{stem}.tif"),
                              read_raster(tmp_path / "single" / f"{stem}.tif")), stem
