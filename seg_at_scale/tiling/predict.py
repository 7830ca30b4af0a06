"""Exact tiled inference and training on in-memory tensors.

``predict_tiled(model, image, q=4)`` equals ``predict_full(model, image)`` (the network
run once on the whole, extended image) to the last bit up to convolution blocking:
tiles read their halo, their origins are aligned, and only their cores are kept.
``tiled_backward`` accumulates the exact whole-image gradient tile by tile.

>>> from seg_at_scale.models import UNet
>>> net = UNet(in_channels=2, num_classes=3, levels=3, base_width=4, padding="same").eval()
>>> x = torch.randn(1, 2, 72, 56)
>>> torch.allclose(predict_tiled(net, x, q=2), predict_full(net, x), atol=1e-5)
True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.tiling.engine import TTA, TensorWindows, plan_batches, read_window, run_batches
from seg_at_scale.tiling.geometry import (
    Footprint,
    Tile,
    TileGrid,
    make_grid,
)
from seg_at_scale.tiling.halo import footprint as model_footprint
from seg_at_scale.tiling.statistic_layers import statistic_sites

__all__ = [
    "iter_tile_outputs",
    "predict_full_tta",
    "read_window",
    "extend",
    "predict_full",
    "predict_tiled",
    "refuse_tile_statistics",
    "refuse_training_norms",
    "check_image",
    "tiled_backward",
    "run_tile",
]


def extend(image: Tensor, fp: Footprint) -> Tensor:
    """The extended image the untiled reference computation reads."""
    ext = make_grid(image.shape[-2], image.shape[-1], fp, q=1).extended
    return read_window(image, ext, fp)


def run_tile(model: nn.Module, image: Tensor, tile: Tile, fp: Footprint) -> Tensor:
    """Model output for one tile, cropped to its core: ``[B, K, core_h, core_w]``."""
    x = read_window(image, tile.read, fp)
    y = model(x)
    return y[..., tile.crop.row : tile.crop.row_end, tile.crop.col : tile.crop.col_end]


@torch.no_grad()
def predict_full(model: nn.Module, image: Tensor, fp: Footprint | None = None) -> Tensor:
    """Untiled reference: ``model(extend(image))`` cropped to ``[B, K, H, W]``."""
    fp = fp or model_footprint(model)
    y = model(extend(image, fp))
    return y[..., : image.shape[-2], : image.shape[-1]]


@torch.no_grad()
def predict_tiled(model: nn.Module, image: Tensor, *, q: int | tuple[int, int] | None = None,
                  tile_size: int | tuple[int, int] | None = None, fp: Footprint | None = None,
                  autocast: torch.dtype | None = None, out_dtype: torch.dtype = torch.float32,
                  tta: str | None = None, channels_last: bool = False) -> Tensor:
    """Tiled logits for ``image [B, C, H, W]`` (or ``[C, H, W]``), exactly the untiled ones.

    Args:
        model: the network, in eval mode for exactness (train-mode norms see tile statistics).
        image: input tensor; stays where it is, tiles are moved to the model's device and
            their cores back to the image's (a scene in host memory, a network on a GPU).
        q: tiles per side, or
        tile_size: largest input window per tile.
        fp: footprint; computed from the model when omitted.
        autocast: run tiles under ``torch.autocast`` with this dtype (e.g. ``torch.bfloat16``),
            the fast path; ``None`` keeps full precision (the exact reference).
        out_dtype: dtype of the returned logits.
        tta: ``"flips"`` or ``"d4"``: the mean softmax over those transforms of the image
            (each predicted exactly), instead of logits.
        channels_last: tiles in NHWC layout (faster convolutions on CPU; give the model
            ``model.to(memory_format=torch.channels_last)`` too). The result stays within
            float rounding of the contiguous one, so fp32 exactness holds.

    Returns:
        Logits (or TTA probabilities) ``[B, K, H, W]`` (``[K, H, W]`` for an unbatched input),
        on the image's device, as the untiled forward's: an image on the GPU keeps its
        tiles' outputs there, with no copy to the host and no wait for each tile.
    """
    refuse_training_norms(model, "predict_tiled")
    check_image(model, image, "predict_tiled", autocast)
    squeeze = image.dim() == 3
    image = image.unsqueeze(0) if squeeze else image
    fp = fp or model_footprint(model)
    grid = make_grid(image.shape[-2], image.shape[-1], fp, q=q, tile_size=tile_size)
    if len(grid) > 1:
        refuse_tile_statistics(model)
    device = next(model.parameters()).device
    out: Tensor | None = None
    for tile, y in iter_tile_outputs(model, image, grid, device=device, autocast=autocast,
                                     tta=tta, channels_last=channels_last):
        if out is None:
            out = torch.empty(image.shape[0], y.shape[1], *image.shape[-2:], dtype=out_dtype,
                              device=image.device)
        out[..., tile.core.row : tile.core.row_end, tile.core.col : tile.core.col_end] = y.to(
            image.device, out_dtype)
    assert out is not None
    return out.squeeze(0) if squeeze else out


def check_image(model: nn.Module, image: Tensor, who: str,
                autocast: torch.dtype | None = None) -> None:
    """Refuse an input the network cannot take, before any tile, in one line.

    ``[B, C, H, W]`` or ``[C, H, W]``, floating point (normalised) of the network's dtype
    unless under ``autocast``, with the channels it takes (``in_channels``); torch's own
    words came from inside a tile's forward.
    """
    if image.dim() not in (3, 4):
        raise ConfigError(f"{who}: the image is {list(image.shape)}; give [B, C, H, W] or "
                          "[C, H, W]")
    if not image.is_floating_point():
        raise ConfigError(f"{who}: the image is {image.dtype}; give it normalised, as floats "
                          "(e.g. Normalizer, then torch.from_numpy)")
    weight = next(model.parameters(), None)
    if autocast is None and weight is not None and weight.is_floating_point() \
            and image.dtype != weight.dtype:
        raise ConfigError(f"{who}: the image is {image.dtype} and the network {weight.dtype}; "
                          f"give the image as {weight.dtype} (or run under autocast=...)")
    wanted = getattr(model, "in_channels", None)  # the model contract's (a user's: torch's)
    if isinstance(wanted, int) and wanted != image.shape[-3]:
        raise ConfigError(f"{who}: the image has {image.shape[-3]} channels and the network "
                          f"takes {wanted}; give an image of its bands")


def refuse_training_norms(model: nn.Module, who: str) -> None:
    """Refuse a prediction by a network whose BatchNorm is in training mode.

    It normalises with the statistics of what each forward sees (a tile's, not the
    image's: 2.4 off in the logits) and moves its running statistics as it predicts.

    Raises:
        ConfigError: naming the first such layer, and ``model.eval()``.
    """
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
            raise ConfigError(
                f"{who}: {name or 'the model'} ({type(m).__name__}) is in training mode, so "
                "it normalises with the statistics of each tile it sees and changes its "
                "running statistics: call model.eval() first")


def refuse_tile_statistics(model: nn.Module) -> None:
    """Refuse a network whose statistic sites would see each tile's statistic.

    A :class:`~seg_at_scale.tiling.statistic_layers.StatisticSite` with neither a fixed statistic
    nor a recorder computes its tile's statistic, not the whole image's: the tiles would differ
    from the untiled forward with no warning. The statistic passes
    (:func:`~seg_at_scale.tiling.statistic_passes.predict_tiled_exact`) fix them first.

    Raises:
        ConfigError: naming the first such site and the fix.
    """
    loose = [(n, s) for n, s in statistic_sites(model) if s.fixed is None and s.recorder is None]
    if loose:
        name, site = loose[0]
        raise ConfigError(
            f"predict_tiled: {len(loose)} layer(s) of this network compute a whole-image "
            f"statistic (first: {name or 'the model'}, {type(site).__name__}) that a tile "
            "alone cannot: tiling them would not be exact; use "
            "seg_at_scale.tiling.predict_tiled_exact (statistic passes), or one tile (q=1)")


def iter_tile_outputs(model: nn.Module, image: Tensor, grid: TileGrid, *,
                      device: torch.device | str = "cpu", autocast: torch.dtype | None = None,
                      tta: str | None = None, channels_last: bool = False
                      ) -> Iterator[tuple[Tile, Tensor]]:
    """Yield ``(tile, core output [B, K, h, w])`` for every tile of ``grid`` (no gradient)."""
    refuse_training_norms(model, "iter_tile_outputs")
    source = TensorWindows(image, grid.footprint)
    for res in run_batches(model, source, plan_batches(grid.tiles, 1), height=grid.height,
                           width=grid.width, fp=grid.footprint, device=torch.device(device),
                           autocast=autocast, tta=tta, channels_last=channels_last):
        yield from zip(res.batch.tiles, res.outputs, strict=True)


@torch.no_grad()
def predict_full_tta(model: nn.Module, image: Tensor, tta: str,
                     fp: Footprint | None = None) -> Tensor:
    """Untiled reference of test-time augmentation: mean softmax of the transformed images."""
    fp = fp or model_footprint(model)
    views = TTA[tta]
    total = sum(g.invert(torch.softmax(predict_full(model, g.apply(image), fp), 1))
                for g in views)
    return total / len(views)


PixelLoss = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
"""``(logits [B,K,h,w], target [B,h,w]) -> (loss summed over pixels, weight summed)``."""


def tiled_backward(model: nn.Module, image: Tensor, target: Tensor, loss: PixelLoss, *,
                   q: int | tuple[int, int] | None = None,
                   tile_size: int | tuple[int, int] | None = None,
                   fp: Footprint | None = None, shard: tuple[int, int] = (0, 1)) -> Tensor:
    """Accumulate into ``.grad`` the gradient of the whole-image loss, one tile at a time.

    The whole-image loss is ``sum(pixel losses) / sum(pixel weights)`` over all pixels;
    each tile contributes its core's sum divided by the *whole image's* weight, so the
    summed tile gradients equal the whole-image gradient (docs/design.md, "Exact training")
    while only one tile's activations are alive at a time.

    Args:
        model: the network (train or eval mode; exact when it has no whole-tile statistics).
        image: ``[B, C, H, W]``.
        target: ``[B, H, W]`` class ids (ignore index allowed).
        loss: a :data:`PixelLoss`, e.g. :class:`seg_at_scale.tasks.losses.CrossEntropy`.
        q: tiles per side, or
        tile_size: largest input window per tile.
        fp: footprint; computed from the model when omitted.
        shard: ``(rank, world)``: only tiles ``rank, rank + world, ...`` (sample
            parallelism; the ranks' gradients then sum to the whole-image gradient).

    Returns:
        The whole-image loss (detached scalar; this shard's part of it).
    """
    fp = fp or model_footprint(model)
    grid = make_grid(image.shape[-2], image.shape[-1], fp, q=q, tile_size=tile_size)
    with torch.no_grad():
        total_weight = _total_weight(loss, target)
    total = torch.zeros((), dtype=torch.float64)
    rank, world = shard
    for tile in list(grid)[rank::world]:
        y = run_tile(model, image, tile, fp)
        t = target[..., tile.core.row : tile.core.row_end, tile.core.col : tile.core.col_end]
        s, _ = loss(y, t)
        (s / total_weight.to(s.device)).backward()
        total += s.detach().double().cpu()  # the total lives on the host, s on the device
    return (total / total_weight).float()


def _total_weight(loss: PixelLoss, target: Tensor) -> Tensor:
    """Sum of pixel weights over the whole target, without running the model."""
    weight_of = getattr(loss, "pixel_weight", None)
    if weight_of is None:
        raise TypeError("the loss needs a pixel_weight(target) method for exact tiled training")
    return weight_of(target).sum()
