"""Tile grids, halos and exact tiled inference/training."""

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
from seg_at_scale.tiling.statistics import (
    image_pool_mean,
    predict_tiled_two_pass,
    tiled_backward_two_pass,
    whole_image_batch_norm,
)

__all__ = [
    "Footprint", "Tile", "TileGrid", "TilingError", "Window", "make_grid", "random_core",
    "split_axis", "empirical_halo", "footprint", "halo_width", "extend", "iter_tile_outputs",
    "predict_full", "predict_tiled", "read_window", "run_tile", "source_indices",
    "tiled_backward", "whole_image_batch_norm", "image_pool_mean", "predict_tiled_two_pass",
    "tiled_backward_two_pass", "Fill", "cover", "fill_of", "predict_full_tta",
]
