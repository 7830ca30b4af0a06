"""``tile_size=auto`` with several processes: rank 0 measures and every rank takes its tile,
each rank gets a batch, and the labels equal one process's (same threads per process)."""

from __future__ import annotations

import numpy as np
from helpers.prediction import seg_predict

from seg_at_scale.io import read_raster


def test_two_processes_take_rank_0s_tile_and_write_one_processs_labels(cli_case, tmp_path):
    run, image = cli_case
    one = seg_predict(run, image, tmp_path / "one.tif", "ckpt=last", "preview=false")
    two = seg_predict(run, image, tmp_path / "two.tif", "ckpt=last", "preview=false",
                      "processes=2")
    assert one["tiles"] == 1  # the whole scene fits: one tile, untiled
    assert two["tiles"] >= 2 and two["tiles_computed"] < two["tiles"]  # each rank a share
    assert np.array_equal(read_raster(tmp_path / "two.tif"), read_raster(tmp_path / "one.tif"))
