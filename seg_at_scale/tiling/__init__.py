"""Tile grids, halos and exact tiled inference/training.

:func:`infer` is the one entry for predicting a tensor tiled: it picks the exact method the
network allows (untiled, tiles, statistic passes, two passes) or refuses in one line. The
other functions here are its parts, kept public for training (``tiled_backward*``), the
file path and the tests.
"""

from seg_at_scale.tiling.blend import predict_blended
from seg_at_scale.tiling.geometry import (
    Fill,
    Footprint,
    Tile,
    TileGrid,
    TilingError,
    Window,
    cover,
    fill_of,
    make_grid,
    random_core,
    source_indices,
    split_axis,
)
from seg_at_scale.tiling.halo import empirical_halo, footprint, halo_width
from seg_at_scale.tiling.infer import infer
from seg_at_scale.tiling.predict import (
    extend,
    iter_tile_outputs,
    predict_full,
    predict_full_tta,
    predict_tiled,
    read_window,
    run_tile,
    tiled_backward,
)
from seg_at_scale.tiling.statistic_passes import (
    fixed_statistics,
    predict_tiled_exact,
    source_tiles,
    tiled_backward_exact,
)
from seg_at_scale.tiling.statistics import (
    image_pool_mean,
    predict_tiled_two_pass,
    tiled_backward_two_pass,
    whole_image_batch_norm,
)

__all__ = [
    "infer",
    "Footprint", "Tile", "TileGrid", "TilingError", "Window", "make_grid", "random_core",
    "split_axis", "empirical_halo", "footprint", "halo_width", "extend", "iter_tile_outputs",
    "predict_full", "predict_tiled", "read_window", "run_tile", "source_indices",
    "tiled_backward", "whole_image_batch_norm", "image_pool_mean", "predict_tiled_two_pass",
    "tiled_backward_two_pass", "Fill", "cover", "fill_of", "predict_full_tta",
    "predict_tiled_exact", "tiled_backward_exact", "fixed_statistics", "source_tiles",
    "predict_blended",
]
