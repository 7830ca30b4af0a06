"""Exact tiling for networks with whole-image statistics, in extra passes over the tiles.

A network that normalises or pools over its whole input (train-mode BatchNorm, Gated-SCNN's
image-level pooling) is not halo-tileable as it is: a tile sees its own statistic, not the
whole image's (``docs/design.md``). Both are made exact by computing the statistic tile
by tile first, summing only each tile's *core* pixels, then running the tiles with it fixed:

* :func:`whole_image_batch_norm`: one pass over the tiles per BatchNorm layer, in forward
  order, stores the whole-image batch statistics as running statistics (then the eval-mode
  network, tiled or not, computes the train-mode whole-image forward);
* :func:`predict_tiled_two_pass` / :func:`tiled_backward_two_pass`: Gated-SCNN's pooled
  mean from pass 1, inference or the exact gradient in pass 2 (and 3).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from seg_at_scale.devices import module_device
from seg_at_scale.protocols import Capability
from seg_at_scale.tiling.geometry import Footprint, Tile, TileGrid, make_grid
from seg_at_scale.tiling.halo import footprint
from seg_at_scale.tiling.predict import PixelLoss, predict_tiled, read_window, tiled_backward


@runtime_checkable
class ImagePooled(Capability, Protocol):
    """A network that averages features over its whole input (Gated-SCNN's image pooling).

    Tiling needs only this: the features the pooling averages, their downsampling factor,
    and a way to run the network with the average fixed. Models implement it; this module
    knows no model.
    """

    downsampling_factor: int
    has_image_pool: bool

    def pooled_features(self, x: Tensor) -> Tensor:
        """Features ``[B, C, h, w]`` the image-level pooling averages."""
        ...

    def fixed_image_pool(self, pooled: Tensor | None
                         ) -> contextlib.AbstractContextManager[None]:
        """Within the block, the pooling uses ``pooled [B, C, 1, 1]`` instead of the mean."""
        ...

    def footprint(self) -> Footprint:
        """Halo and alignment with the pooling held constant."""
        ...



__all__ = ["ImagePooled", "whole_image_batch_norm", "uses_image_pool", "image_pool_mean",
           "image_pool_mean_of", "image_pool_sum_of", "feature_count",
           "predict_tiled_two_pass", "tiled_backward_two_pass"]


@torch.no_grad()
def whole_image_batch_norm(model: nn.Module, images: Sequence[Tensor], *,
                           q: int | tuple[int, int] | None = None,
                           tile_size: int | tuple[int, int] | None = None) -> int:
    """Set every BatchNorm's running statistics to the whole-image batch statistics.

    Train-mode batch norm normalises with the statistics of what it sees, so a tile sees
    other statistics than the whole image. This computes, tile by tile, the statistics the
    untiled train-mode forward over all ``images`` (each extended as ``predict_full``
    extends it) would use, and stores them (biased variance, as train mode normalises
    with) as running statistics: afterwards the eval-mode network, tiled or not, computes
    exactly the train-mode whole-image forward. A layer's statistics depend on those before
    it, so there is one pass over the tiles per batch-norm layer, in forward order; each
    pass sums only the pixels of each tile's core (at the layer's resolution).

    Args:
        model: a ``same``-padding network with a footprint (left in eval mode).
        images: inputs ``[B, C, H, W]`` (their pixels all count, like one large batch).
        q: tiles per side, or
        tile_size: largest input window.

    Returns:
        The number of passes (batch-norm layers).
    """
    fp = footprint(model)
    order: list[nn.BatchNorm2d] = []
    hooks = [m.register_forward_pre_hook(lambda m, _: order.append(m) if m not in order else None)
             for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    model.eval()
    model(torch.zeros(1, images[0].shape[-3], fp.align, fp.align, device=module_device(model)))
    for h in hooks:
        h.remove()
    for bn in order:
        stats = _CoreStats()
        hook = bn.register_forward_pre_hook(stats)
        for image in images:
            grid = make_grid(image.shape[-2], image.shape[-1], fp, q=q, tile_size=tile_size)
            for tile in grid:  # core in tile coordinates; the last ones reach the extension
                ext, rd = grid.extended, tile.read
                r1 = ext.row_end if tile.core.row_end == grid.height else tile.core.row_end
                c1 = ext.col_end if tile.core.col_end == grid.width else tile.core.col_end
                stats.window = (tile.core.row - rd.row, r1 - rd.row, tile.core.col - rd.col,
                                c1 - rd.col, rd.height, rd.width)
                model(read_window(image, rd, fp))
        hook.remove()
        mean, var = stats.moments()
        assert bn.running_mean is not None and bn.running_var is not None  # track_running_stats
        bn.running_mean.copy_(mean)
        bn.running_var.copy_(var)
    return len(order)


class _CoreStats:
    """Forward pre-hook summing a layer input's core pixels (``window`` in tile pixels)."""

    def __init__(self) -> None:
        self.window = (0, 0, 0, 0, 1, 1)
        self.sums: list[Tensor] = []

    def __call__(self, _: nn.Module, inp: tuple[Tensor, ...]) -> None:
        x = inp[0]
        r0, r1, c0, c1, th, tw = self.window
        s_r, s_c = th // x.shape[-2], tw // x.shape[-1]  # the layer's downsampling
        core = x[..., r0 // s_r : r1 // s_r, c0 // s_c : c1 // s_c].double()
        n = torch.full_like(core[0, :, 0, 0], core[:, 0].numel())
        self.sums.append(torch.stack([core.sum(dim=(0, 2, 3)), (core**2).sum(dim=(0, 2, 3)), n]))

    def moments(self) -> tuple[Tensor, Tensor]:
        """Mean and biased variance per channel over every core pixel seen."""
        total = torch.stack(self.sums).sum(dim=0)
        mean = total[0] / total[2]
        return mean, (total[1] / total[2] - mean**2).clamp_min(0)


def _feature_core(tile: Tile, stride: int) -> tuple[slice, slice]:
    """Where the tile's core lies in its 1/stride feature map (cores are aligned to it)."""
    r0 = (tile.core.row - tile.read.row) // stride
    c0 = (tile.core.col - tile.read.col) // stride
    return (slice(r0, r0 + -(-tile.core.height // stride)),
            slice(c0, c0 + -(-tile.core.width // stride)))


def _tile_inputs(image: Tensor, grid: TileGrid) -> Iterator[tuple[Tile, Tensor]]:
    for tile in grid:
        yield tile, read_window(image, tile.read, grid.footprint)


def _core_feature_sums(model: ImagePooled, tile_inputs: Iterable[tuple[Tile, Tensor]]
                       ) -> Iterator[Tensor]:
    """Per tile: the last backbone features summed over the core ``[B, C, 1, 1]``."""
    assert isinstance(model, nn.Module)  # the protocol's implementers are networks
    device = next(model.parameters()).device
    for tile, x in tile_inputs:
        rows, cols = _feature_core(tile, model.downsampling_factor)
        yield model.pooled_features(x.to(device))[..., rows, cols].sum(dim=(2, 3), keepdim=True)


def feature_count(model: ImagePooled, grid: TileGrid) -> int:
    """Feature pixels the image pooling averages over (the extended image's)."""
    s = model.downsampling_factor
    return (grid.extended.height // s) * (grid.extended.width // s)


def uses_image_pool(model: nn.Module) -> bool:
    """Whether ``model`` averages features over its whole input (:class:`ImagePooled`)."""
    return isinstance(model, ImagePooled) and bool(model.has_image_pool)


@torch.no_grad()
def image_pool_mean(model: ImagePooled, image: Tensor, grid: TileGrid) -> Tensor:
    """Pass 1: the whole image's mean of the pooled features ``[B, C, 1, 1]``, tile by tile.

    Equals ``model.pooled_features(extend(image)).mean((2, 3))`` up to summation order
    (accumulated in float64).
    """
    return image_pool_mean_of(model, _tile_inputs(image, grid), grid)


@torch.no_grad()
def image_pool_mean_of(model: ImagePooled, tile_inputs: Iterable[tuple[Tile, Tensor]],
                       grid: TileGrid) -> Tensor:
    """:func:`image_pool_mean` from ``(tile, input window)`` pairs covering ``grid``.

    For inputs that are not one tensor in memory: :func:`seg_at_scale.prediction.predict_raster`
    streams the windows from the raster file.
    """
    total, dtype = image_pool_sum_of(model, tile_inputs)
    return (total / feature_count(model, grid)).to(dtype)


@torch.no_grad()
def image_pool_sum_of(model: ImagePooled, tile_inputs: Iterable[tuple[Tile, Tensor]]
                      ) -> tuple[Tensor, torch.dtype]:
    """Sum (float64) of the tiles' core features and the features' dtype.

    Processes that each see part of the tiles all-reduce these sums, then divide by
    :func:`feature_count`: the same mean as one process, in any split.
    """
    total: Tensor | None = None
    dtype = torch.float32
    for s in _core_feature_sums(model, tile_inputs):
        total = s.double() if total is None else total + s.double()
        dtype = s.dtype
    if total is None:
        raise ValueError("image_pool_sum_of needs at least one tile")
    return total, dtype


def _grid(model: ImagePooled, image: Tensor, q: int | tuple[int, int] | None,
          tile_size: int | tuple[int, int] | None, fp: Footprint | None) -> TileGrid:
    return make_grid(image.shape[-2], image.shape[-1], fp or model.footprint(), q=q,
                     tile_size=tile_size)


def predict_tiled_two_pass(model: ImagePooled, image: Tensor, *,
                           q: int | tuple[int, int] | None = None,
                           tile_size: int | tuple[int, int] | None = None,
                           fp: Footprint | None = None,
                           autocast: torch.dtype | None = None,
                           out_dtype: torch.dtype = torch.float32) -> Tensor:
    """Exact tiled inference for Gated-SCNN: pass 1 pools, pass 2 predicts.

    Args:
        model: the network in eval mode.
        image: ``[B, C, H, W]``.
        q: tiles per side, or
        tile_size: largest input window.
        fp: footprint (default ``model.footprint()``).
        autocast: as for :func:`~seg_at_scale.tiling.predict_tiled`.
        out_dtype: dtype of the returned output.

    Returns:
        The model's output ``[B, K, H, W]``, equal to ``predict_full(model, image)``.
    """
    assert isinstance(model, nn.Module)  # the protocol's implementers are networks
    grid = _grid(model, image, q, tile_size, fp)
    pooled = image_pool_mean(model, image, grid) if uses_image_pool(model) else None
    with model.fixed_image_pool(pooled):
        return predict_tiled(model, image, q=q, tile_size=tile_size, fp=grid.footprint,
                             autocast=autocast, out_dtype=out_dtype)


def tiled_backward_two_pass(model: ImagePooled, image: Tensor, target: Tensor, loss: PixelLoss, *,
                            q: int | tuple[int, int] | None = None,
                            tile_size: int | tuple[int, int] | None = None,
                            fp: Footprint | None = None) -> Tensor:
    """Exact whole-image gradient of a pixel loss on the segmentation, tile by tile.

    The loss depends on the parameters directly and through the pooled mean ``p``:
    ``dL/dθ = Σ_t ∂L_t/∂θ|_p + (Σ_t ∂L_t/∂p) · dp/dθ``. Pass 1 computes ``p``; pass 2 runs
    :func:`~seg_at_scale.tiling.tiled_backward` with ``p`` fixed and collecting its gradient
    ``g``; pass 3 back-propagates ``g · dp/dθ`` through each tile's core features. Exact
    when the network has no other whole-tile statistic (``norm="none"`` or eval mode).

    Returns:
        The whole-image loss (detached scalar).
    """
    assert isinstance(model, nn.Module)  # the protocol's implementers are networks
    grid = _grid(model, image, q, tile_size, fp)
    if not uses_image_pool(model):
        return tiled_backward(model, image, target, loss, q=q, tile_size=tile_size,
                              fp=grid.footprint)
    p = image_pool_mean(model, image, grid).requires_grad_(True)
    with model.fixed_image_pool(p):
        value = tiled_backward(model, image, target, loss, q=q, tile_size=tile_size,
                               fp=grid.footprint)
    if p.grad is not None:
        g = p.grad / feature_count(model, grid)
        for s in _core_feature_sums(model, _tile_inputs(image, grid)):
            (s * g).sum().backward()
    return value
