"""Exact tiling of networks with statistic sites, in one extra pass per level of sites.

A network whose layers take whole-image statistics (:mod:`seg_at_scale.tiling.statistic_layers`:
DeepLab's image pooling, FPN's GroupNorms) is tiled exactly in passes over the tiles:

1. pass k (one per :func:`~seg_at_scale.tiling.statistic_layers.site_levels` level): the sites of
   level k record the float64 sums of each tile's core pixels, the sites of the levels
   before are held at their whole-image statistics; the forward stops as soon as the
   level's sites have recorded (a level-1 pass of DeepLabV3+ runs only the encoder);
2. the final pass runs the tiles with every statistic fixed: the stitched cores equal the
   whole-image forward (:func:`predict_tiled_exact`). ``predict_raster`` (``seg-predict``)
   runs these passes itself over windows read from the file (:func:`source_tiles`), each
   rank over its share, the sums all-reduced: call it directly, not inside
   :func:`fixed_statistics` (a model whose sites are already fixed is refused).

:func:`tiled_backward_exact` adds reverse passes: the final pass collects the gradient of
the whole-image loss with respect to each fixed statistic, and one pass per level, deepest
first, back-propagates it through the sums that produced the statistic (into the
parameters and into the statistics of the levels before): the whole-image gradient,
accumulated tile by tile.

>>> from seg_at_scale.tiling.geometry import Footprint
>>> net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), GroupNormSite(2, 4), nn.Conv2d(4, 2, 1))
>>> x = torch.randn(1, 1, 40, 56)
>>> fp = Footprint(halo=1, align=1)
>>> ref = predict_full(net, x, fp)
>>> torch.allclose(predict_tiled_exact(net, x, q=3, fp=fp), ref, atol=1e-5)
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.tiling.geometry import Footprint, Tile, TileGrid, Window, make_grid
from seg_at_scale.tiling.halo import footprint as model_footprint
from seg_at_scale.tiling.predict import (  # noqa: F401 (predict_full: the doctest)
    PixelLoss,
    predict_full,
    predict_tiled,
    read_window,
    tiled_backward,
)
from seg_at_scale.tiling.statistic_layers import (  # noqa: F401 (GroupNormSite: the doctest)
    GroupNormSite,
    StatisticSite,
    site_levels,
    statistic_sites,
)
from seg_at_scale.tiling.statistics import uses_image_pool

__all__ = ["has_statistics", "statistic_passes", "fixed_statistics", "predict_tiled_exact",
           "tiled_backward_exact", "TileInputs", "tensor_tiles", "source_tiles",
           "WindowReader", "check_no_tta"]

TileInputs = Callable[[], Iterable[tuple[Tile, Tensor | list[Tensor]]]]
"""Returns a fresh iterable of ``(tile, model input window [B, C, h, w])`` over a grid.

A stage's module (:mod:`~seg_at_scale.tiling.staged.stages`) takes the list of its input windows.
"""


class _Stop(Exception):
    """Raised by a recorder once every site of the pass has recorded (ends the forward)."""


@dataclass
class _LevelRecorder:
    """Sums the core pixels of one level's sites, tile by tile (see the module docstring)."""

    sites: list[StatisticSite]
    grid: TileGrid
    differentiable: bool = False
    window: tuple[int, int, int, int, int, int] = (0, 0, 0, 0, 1, 1)
    totals: dict[int, Tensor] = field(default_factory=dict)
    tile_sums: dict[int, Tensor] = field(default_factory=dict)

    def start(self, tile: Tile) -> None:
        """The next forward is ``tile``'s: note its core in its input window."""
        ext, rd = self.grid.extended, tile.read
        # the last tiles' cores reach the extension: its pixels count (whole-image forward)
        r1 = ext.row_end if tile.core.row_end == self.grid.height else tile.core.row_end
        c1 = ext.col_end if tile.core.col_end == self.grid.width else tile.core.col_end
        self.window = (tile.core.row - rd.row, r1 - rd.row, tile.core.col - rd.col,
                       c1 - rd.col, rd.height, rd.width)
        self.tile_sums = {}

    def __call__(self, site: StatisticSite, x: Tensor) -> None:
        r0, r1, c0, c1, th, tw = self.window
        s_r, s_c = th // x.shape[-2], tw // x.shape[-1]  # the site's downsampling
        core = x[..., r0 // s_r : r1 // s_r, c0 // s_c : c1 // s_c]
        sums = site.sums(core) if self.differentiable else site.sums(core.detach())
        key = id(site)
        self.tile_sums[key] = sums
        if not self.differentiable:
            self.totals[key] = self.totals[key] + sums if key in self.totals else sums
        if len(self.tile_sums) == len(self.sites):
            raise _Stop


def has_statistics(model: nn.Module) -> bool:
    """Whether ``model`` holds statistic sites (it then needs :func:`predict_tiled_exact`)."""
    return bool(statistic_sites(model))


def _levels(model: nn.Module, grid: TileGrid, first: tuple[Tile, Any]
            ) -> list[list[StatisticSite]]:
    """The sites of each level, found on a probe shaped as the first tile's input.

    The input is one window, or (a stage of :mod:`seg_at_scale.tiling.staged.stages`) a list of
    windows at their own strides: each probe window keeps its stride from the tile's read.
    """
    a, (tile, example) = grid.footprint.align, first

    def zeros(x: Tensor) -> Tensor:
        s = max(tile.read.height // max(x.shape[-2], 1), 1)
        return x.new_zeros(1, x.shape[1], max(2 * a // s, 1), max(2 * a // s, 1))

    probe = [zeros(x) for x in example] if isinstance(example, list) else zeros(example)
    levels = site_levels(model, probe)
    depth = max(levels.values(), default=0)
    return [[s for s, k in levels.items() if k == level] for level in range(1, depth + 1)]


def _run(model: nn.Module, x: Tensor | list[Tensor]) -> None:
    try:
        model(x)
    except _Stop:
        pass


@contextlib.contextmanager
def _recording(sites: list[StatisticSite], recorder: _LevelRecorder) -> Iterator[None]:
    for s in sites:
        s.recorder = recorder
    try:
        yield
    finally:
        for s in sites:
            s.recorder = None


@torch.no_grad()
def statistic_passes(model: nn.Module, tiles: TileInputs, grid: TileGrid, *,
                     reduce: Callable[[Tensor], Tensor] | None = None
                     ) -> list[tuple[list[StatisticSite], dict[int, Tensor]]]:
    """Passes 1..L: every site's whole-image statistic is set as its ``fixed`` value.

    Args:
        model: the network in eval mode, its sites not fixed.
        tiles: ``(tile, input window)`` pairs covering ``grid``, each call a fresh pass
            (or this process's share of them, with ``reduce``).
        grid: the tile grid (for the cores and the extended image).
        reduce: applied to every level's float64 sums before the statistic is taken, e.g.
            ``lambda t: (dist.all_reduce(t), t)[1]`` when processes each pass a share of
            the tiles (every process then holds the whole image's statistics).

    Returns:
        Per level, its sites and their float64 sums (keyed by ``id(site)``).
    """
    if grid.footprint.padding == "valid":  # the recorder maps cores by stride alone
        raise ConfigError("whole-image statistics (GroupNorm, image pooling) are tiled exactly "
                          "for same-padding networks only; this one shrinks its input (valid "
                          "padding): use padding='same'")
    held = [n for n, s in statistic_sites(model) if s.fixed is not None]
    if held:
        raise ValueError(f"statistic_passes: the sites {held} already hold a statistic (inside "
                         "fixed_statistics?); run the passes once, outside it")
    first = next(iter(tiles()), None)
    if first is None:
        raise ValueError("statistic_passes needs at least one tile")
    x0 = first[1][0] if isinstance(first[1], list) else first[1]
    done, dtype = [], x0.dtype
    for sites in _levels(model, grid, first):
        rec = _LevelRecorder(sites, grid)
        with _recording(sites, rec):
            for tile, x in tiles():
                rec.start(tile)
                _run(model, x)
        for s in sites:
            if reduce is not None:
                rec.totals[id(s)] = reduce(rec.totals[id(s)])
            s.fixed = s.statistic(rec.totals[id(s)]).to(dtype)
        done.append((sites, rec.totals))
    return done


@contextlib.contextmanager
def fixed_statistics(model: nn.Module, tiles: TileInputs, grid: TileGrid, *,
                     reduce: Callable[[Tensor], Tensor] | None = None) -> Iterator[None]:
    """Within the block, every site holds the whole image's statistic (passes 1..L).

    ``reduce`` as for :func:`statistic_passes` (processes sharing the tiles).
    """
    sites = [s for _, s in statistic_sites(model)]
    try:
        statistic_passes(model, tiles, grid, reduce=reduce)
        yield
    finally:
        for s in sites:
            s.fixed = None


def tensor_tiles(image: Tensor, grid: TileGrid, device: torch.device | None = None
                 ) -> TileInputs:
    """:data:`TileInputs` of an in-memory, already normalised image ``[B, C, H, W]``."""
    def tiles() -> Iterator[tuple[Tile, Tensor]]:
        for tile in grid:
            x = read_window(image, tile.read, grid.footprint)
            yield tile, x if device is None else x.to(device)

    return tiles


class WindowReader(Protocol):
    """Anything that reads model input windows: ``read(window) -> (array [C, h, w], mask)``.

    :class:`seg_at_scale.data.windows.RasterWindows` reads them from a raster file.
    """

    def read(self, window: Window) -> tuple[Any, Any]:
        """The normalised input of ``window`` (filled outside the image) and its mask."""
        ...


def source_tiles(source: WindowReader, grid: TileGrid | Iterable[Tile],
                 device: torch.device | None = None) -> TileInputs:
    """:data:`TileInputs` read window by window (a raster file: nothing whole in memory).

    ``grid``: all its tiles, or only some (a rank's share, whose sums are then reduced).
    """
    def tiles() -> Iterator[tuple[Tile, Tensor]]:
        for tile in grid:
            x = torch.as_tensor(source.read(tile.read)[0])[None]
            yield tile, x if device is None else x.to(device)

    return tiles


def _grid(model: nn.Module, image: Tensor, q: int | tuple[int, int] | None,
          tile_size: int | tuple[int, int] | None, fp: Footprint | None) -> TileGrid:
    return make_grid(image.shape[-2], image.shape[-1], fp or model_footprint(model), q=q,
                     tile_size=tile_size)


def predict_tiled_exact(model: nn.Module, image: Tensor, *,
                        q: int | tuple[int, int] | None = None,
                        tile_size: int | tuple[int, int] | None = None,
                        fp: Footprint | None = None, autocast: torch.dtype | None = None,
                        out_dtype: torch.dtype = torch.float32,
                        channels_last: bool = False) -> Tensor:
    """Tiled logits ``[B, K, H, W]`` equal to ``predict_full(model, image)``, any sites.

    As :func:`~seg_at_scale.tiling.predict_tiled` (same arguments), after the statistic
    passes when the model has sites (test-time augmentation is not offered here: each
    view of the image would need its own statistics).
    """
    if image.dim() == 3:  # [C, H, W], as predict_tiled takes it
        return predict_tiled_exact(model, image[None], q=q, tile_size=tile_size, fp=fp,
                                   autocast=autocast, out_dtype=out_dtype,
                                   channels_last=channels_last)[0]
    grid = _grid(model, image, q, tile_size, fp)
    if not has_statistics(model) or len(grid) == 1:  # one tile: the untiled forward itself
        return predict_tiled(model, image, q=q, tile_size=tile_size, fp=grid.footprint,
                             autocast=autocast, out_dtype=out_dtype,
                             channels_last=channels_last)
    device = next(model.parameters()).device
    with fixed_statistics(model, tensor_tiles(image, grid, device), grid):
        return predict_tiled(model, image, q=q, tile_size=tile_size, fp=grid.footprint,
                             autocast=autocast, out_dtype=out_dtype,
                             channels_last=channels_last)


def tiled_backward_exact(model: nn.Module, image: Tensor, target: Tensor, loss: PixelLoss, *,
                         q: int | tuple[int, int] | None = None,
                         tile_size: int | tuple[int, int] | None = None,
                         fp: Footprint | None = None) -> Tensor:
    """Accumulate the exact whole-image gradient into ``.grad``, tile by tile, any sites.

    Exact when the network has no other whole-tile statistic (BatchNorm in eval mode or
    frozen). See the module docstring for the passes.

    Returns:
        The whole-image loss (detached scalar).
    """
    grid = _grid(model, image, q, tile_size, fp)
    if not has_statistics(model):
        return tiled_backward(model, image, target, loss, q=q, tile_size=tile_size,
                              fp=grid.footprint)
    tiles = tensor_tiles(image, grid, next(model.parameters()).device)
    sites = [s for _, s in statistic_sites(model)]
    try:
        levels = statistic_passes(model, tiles, grid)
        leaves = {id(s): cast(Tensor, s.fixed).detach().requires_grad_(True)  # set: the passes
                  for lv, _ in levels for s in lv}
        for lv, _ in levels:
            for s in lv:
                s.fixed = leaves[id(s)]
        value = tiled_backward(model, image, target, loss, q=q, tile_size=tile_size,
                               fp=grid.footprint)
        for sites_k, totals in reversed(levels):
            _backward_level(model, tiles, grid, sites_k, totals, leaves)
        return value
    finally:
        for s in sites:
            s.fixed = None


def _backward_level(model: nn.Module, tiles: TileInputs, grid: TileGrid,
                    sites: list[StatisticSite], totals: dict[int, Tensor],
                    leaves: dict[int, Tensor]) -> None:
    """Back-propagate the gradient of one level's statistics through its core sums."""
    weights: dict[int, Tensor] = {}
    for s in sites:
        g = leaves[id(s)].grad
        if g is None:
            continue
        total = totals[id(s)].detach().requires_grad_(True)
        (s.statistic(total).to(g.dtype) * g).sum().backward()
        assert total.grad is not None
        weights[id(s)] = total.grad
    if not weights:
        return
    held = {id(s): s.fixed for s in sites}
    for s in sites:
        s.fixed = None  # record again, now with gradients
    rec = _LevelRecorder(sites, grid, differentiable=True)
    try:
        with _recording(sites, rec):
            for tile, x in tiles():
                rec.start(tile)
                _run(model, x)
                part = sum((rec.tile_sums[k] * w).sum() for k, w in weights.items()
                           if k in rec.tile_sums)
                if isinstance(part, Tensor) and part.requires_grad:
                    part.backward()
    finally:
        for s in sites:
            s.fixed = held[id(s)]


def check_no_tta(model: nn.Module, tta: str | None) -> None:
    """Refuse test-time augmentation for a model with whole-image statistics (one line).

    Each augmented view would need its own statistics; the passes compute the plain image's.
    """
    if tta is None:
        return
    if has_statistics(model):
        names = ", ".join(n for n, _ in statistic_sites(model))
    elif uses_image_pool(model):
        names = "its image-level pooling"
    else:
        return
    raise ConfigError(f"tta={tta!r}: this model takes whole-image statistics ({names}), "
                      "which each augmented view would need computed again; use tta=null")
