"""Stage-wise exact tiling: each stage of a network tiled over whole feature maps.

Tiling the whole network makes every tile read the whole network's halo (837 px for a
DeepLabV3+-ResNet50, 892 for a ConvNeXt-T U-Net), so a tile that fits memory computes
twice its core or more. Run stage by stage instead (the encoder's stages, then the
decoder with its head), each tiled over the *whole* feature maps it reads, with its own
halo: a stem's halo is a few pixels, and the deep stages, whose maps are small, run as
one tile. The work approaches the untiled forward's (E near 1) while each stage's tile
holds at most ``budget`` floats: its input windows and the most its forward holds at once
(a ConvNeXt block's 4x MLP, a U-Net decoder's upsampled maps), measured per pixel when the
stages are planned (:class:`~seg_at_scale.tiling.staged.peak_memory.LiveMemory`).

Exactness is the image tiles' rule applied to each stage: its windows start on its
alignment (its deepest stride, in image pixels), read its halo past the core and stop at
the map's edge, where the whole map's padding applies; so each stitched map equals the
whole-map stage output, and the last one equals ``predict_full``. Whole-image statistics
inside a stage (DeepLab's image pooling, GroupNorm) are taken by the statistic passes
over that stage's tiles (:mod:`seg_at_scale.tiling.statistic_passes`); a stage that starts with its
sites (DeepLab's ASPP, each of FPN's GroupNorms: :mod:`seg_at_scale.models.smp_stage_split`)
makes a pass cost almost nothing, as it reads a stored map instead of computing the
network up to it again.

Every map a later stage reads is kept whole until then, in memory or (``store=``) in files
read and written window by window (:class:`~seg_at_scale.tiling.feature_files.DiskMap`),
so the process holds one stage tile; maps no stage reads any more are dropped as soon as
they are consumed. Inference only (no gradients).

>>> down = Chain(nn.Conv2d(1, 4, 3, 2, 1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
>>> up = Chain(nn.Upsample(scale_factor=2.0), nn.Conv2d(4, 2, 3, padding=1))
>>> stages = [Stage("down", down, (0,), 2), Stage("up", up, (1,), 1)]
>>> x = torch.randn(1, 1, 90, 70)
>>> with torch.no_grad():
...     ref = up([down([extend(x, Footprint(0, 2))])])[..., :90, :70]
>>> e = []
>>> y = predict_staged(stages, x, align=2, budget=2000, efficiency=e)
>>> torch.allclose(y, ref, atol=1e-6), len(e)
(True, 2)
"""

from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn

from seg_at_scale.tiling.feature_files import DiskMap
from seg_at_scale.tiling.geometry import Footprint, Tile, TileGrid, make_grid
from seg_at_scale.tiling.halo import GLOBAL_SIZE, WholeImageDependency, structural_copy
from seg_at_scale.tiling.predict import extend
from seg_at_scale.tiling.staged.heap_return import give_back_heap, large_tensors_mapped
from seg_at_scale.tiling.staged.peak_memory import LiveMemory
from seg_at_scale.tiling.statistic_passes import fixed_statistics, has_statistics

__all__ = ["Chain", "Map", "WindowMap", "give_back_heap", "read_map", "staged_maps", "Stage",
           "StagePlan", "plan_stages", "predict_staged", "stage_halo", "widest_tap"]


class Chain(nn.Module):
    """A stage module running ``modules`` in turn on its one input (shared, not copied)."""

    def __init__(self, *modules: nn.Module) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)

    def forward(self, xs: list[Tensor]) -> Tensor:
        (x,) = xs
        for m in self.parts:
            x = m(x)
        return x


@dataclass(frozen=True)
class Stage:
    """One step of a staged network: ``module([maps[i] for i in inputs]) -> its map``.

    Map 0 is the (extended) image; stage ``k`` writes map ``k + 1``.

    Attributes:
        name: shown in logs and errors.
        module: takes the list of its input windows ``[B, C_i, h_i, w_i]`` and returns
            ``[B, C, h, w]`` at ``stride``. A module with ``computes_core = True`` also
            takes ``core=(rows, cols)``, the slices of its output the tile keeps, and
            ``edges=(top, bottom, left, right)``, whether each side of the window is the
            map's edge, and returns the core alone, computing only what it needs
            (:mod:`seg_at_scale.tiling.staged.core_only`: an ASPP branch's pointwise convolution not
            on the halo, each ConvNeXt block on a window shrinking to the core).
        inputs: indices of the maps it reads.
        stride: its output's downsampling factor from the image.
    """

    name: str
    module: nn.Module
    inputs: tuple[int, ...]
    stride: int


@dataclass(frozen=True)
class StagePlan:
    """What tiling each stage needs, found once per network (:func:`plan_stages`).

    Attributes:
        strides: of every map (map 0: 1).
        channels: of every map.
        footprints: per stage: its halo and alignment, in image pixels.
        used: per stage: which of its inputs it reads values from (the others only lend
            their shape, e.g. smp's U-Net decoder and the input image).
        holds: per stage: the most floats its forward holds at once (its output among
            them, its inputs not), per image pixel of its window (:class:`LiveMemory` at
            two sizes); empty: its output's alone.
    """

    strides: tuple[int, ...]
    channels: tuple[int, ...]
    footprints: tuple[Footprint, ...]
    used: tuple[tuple[bool, ...], ...]
    holds: tuple[float, ...] = ()

    def last_reads(self, stages: Sequence[Stage]) -> dict[int, int]:
        """The last stage that reads each map's values (maps are dropped after it)."""
        last: dict[int, int] = {}
        for k, st in enumerate(stages):
            for i, u in zip(st.inputs, self.used[k], strict=True):
                if u:
                    last[i] = k
        return last

    def disk_bytes(self, stages: Sequence[Stage], height: int, width: int, batch: int = 1,
                   itemsize: int = 4) -> int:
        """The most bytes the maps in files (``store=`` / ``folder=``) hold at one time.

        While stage ``k`` runs, its output is being written and every earlier map a stage
        ``>= k`` still reads is kept (the image, map 0, is the caller's); ``height`` and
        ``width`` are the extended image's.
        """
        def size(i: int) -> int:
            s = self.strides[i]
            return batch * self.channels[i] * (height // s) * (width // s) * itemsize

        last = self.last_reads(stages)
        return max((sum(size(i) for i in range(1, k + 1) if last.get(i, -1) >= k)
                    + size(k + 1) for k in range(len(stages))), default=0)


class WindowMap(Protocol):
    """A map read by window, e.g. the image from a raster file (``shape``: extended)."""

    shape: torch.Size

    def read(self, rows: slice, cols: slice) -> Tensor:
        """The window ``[B, C, rows, cols]``."""
        ...


Map = Tensor | DiskMap | WindowMap
"""A whole feature map: in memory, in a file (``store=``), or read by window."""


def read_map(m: Map, rows: slice, cols: slice) -> Tensor:
    """The window ``[B, C, rows, cols]`` of any :data:`Map`."""
    return m[..., rows, cols] if isinstance(m, Tensor) else m.read(rows, cols)


def _shape_only(m: Map) -> bool:
    return isinstance(m, Tensor) and m.dim() > 0 and m.stride(-1) == 0


def _windows(maps: list[Map], st: Stage, strides: Sequence[int], tile: Tile,
             channels_last: bool, device: torch.device, used: Sequence[bool]) -> list[Tensor]:
    """The stage's input windows for ``tile`` (image-pixel windows divided by each stride).

    An input the stage reads for its shape only (``used``: the probe found no gradient
    through it, e.g. the image for a timm encoder's empty stride-2 stage) is not read: a
    zero-stride tensor of the window's shape stands for it.
    """
    out = []
    rd = tile.read
    for j, i in enumerate(st.inputs):
        s = strides[i]
        rows, cols = slice(rd.row // s, rd.row_end // s), slice(rd.col // s, rd.col_end // s)
        if not used[j]:
            b, c = maps[i].shape[:2]
            dtype = getattr(maps[i], "dtype", torch.float32)
            out.append(torch.zeros((), dtype=dtype, device=device).expand(
                b, c, rows.stop - rows.start, cols.stop - cols.start))
            continue
        w = read_map(maps[i], rows, cols)
        if w.stride(-1) == 0:  # a shape-only map (never read): keep it free
            out.append(w.to(device))
            continue
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        out.append(w.to(device).contiguous(memory_format=fmt))
    return out


def stage_halo(module: nn.Module, strides: Sequence[int], channels: Sequence[int],
               out_stride: int, align: int, max_size: int = 4096
               ) -> tuple[int, tuple[bool, ...]]:
    """Halo (image pixels) of one stage and which inputs it reads, by back-propagation.

    The probe of :func:`seg_at_scale.tiling.halo.empirical_halo` (a positive, linear
    float64 copy of the module; strips two alignments wide, one axis at a time), with
    several inputs at their own strides: the reach of one aligned block of outputs into
    each input, in image pixels. An input with no gradient is only used for its shape.
    """
    # the probe back-propagates, also when called under no_grad or inference_mode (where
    # enable_grad alone still makes tensors that cannot require a gradient)
    with torch.inference_mode(False), torch.enable_grad():
        return _stage_halo(module, strides, channels, out_stride, align, max_size)


def _stage_halo(module: nn.Module, strides: Sequence[int], channels: Sequence[int],
                out_stride: int, align: int, max_size: int) -> tuple[int, tuple[bool, ...]]:
    net = structural_copy(module)
    # dilated taps past a small probe read only padding: start where the widest one fits
    size = max(8 * align, 64, max(strides) * (4 * widest_tap(net) + 8))
    size = align * math.ceil(size / align)
    whole_before, before = False, 0
    used = [False] * len(strides)
    while True:
        left = right = 0
        touched, whole = False, True
        for axis in (-2, -1):
            shape = (size, 2 * align) if axis == -2 else (2 * align, size)
            xs = [torch.ones(1, c, shape[0] // s, shape[1] // s, dtype=torch.float64,
                             requires_grad=True) for c, s in zip(channels, strides, strict=True)]
            y = net(xs)
            if not y.requires_grad:  # reads no input values (a placeholder map)
                return 0, tuple(used)
            blk = max(align // out_stride, 1)
            n_out = y.shape[axis]
            i = n_out // 2 - n_out // 2 % blk - blk
            if i < blk:
                raise ValueError(f"stage probe: output under {3 * blk} pixels at {size}")
            grads = torch.autograd.grad(y.narrow(axis, i, blk).sum(), xs, allow_unused=True)
            b0, b1 = i * out_stride, (i + blk) * out_stride - 1
            for k, (g, s) in enumerate(zip(grads, strides, strict=True)):
                if g is None or g.numel() == 0:
                    continue
                dims = tuple(d for d in range(g.dim()) if d != g.dim() + axis)
                hit = g.abs().sum(dim=dims).nonzero().flatten()
                if len(hit) == 0:
                    continue
                used[k] = True
                lo, hi, n = int(hit[0]), int(hit[-1]), g.shape[axis]
                touched = touched or lo == 0 or hi == n - 1
                whole = whole and lo == 0 and hi == n - 1
                left, right = max(left, b0 - lo * s), max(right, (hi + 1) * s - 1 - b1)
        halo = max(left, right)
        if whole and whole_before and size >= GLOBAL_SIZE:
            raise WholeImageDependency(f"output pixels depend on the whole input at {before} "
                                       f"and {size} pixels")
        if not touched or size >= max_size:
            return halo, tuple(used)
        whole_before, before, size = whole, size, 2 * size


def widest_tap(net: nn.Module) -> int:
    """The largest reach of one convolution or pooling, in its own input's pixels."""
    reach = 0
    for m in net.modules():
        if isinstance(m, nn.Conv2d | nn.MaxPool2d | nn.AvgPool2d):
            k, d = m.kernel_size, getattr(m, "dilation", 1)
            kk = max(k) if isinstance(k, tuple) else k
            dd = max(d) if isinstance(d, tuple) else d
            reach = max(reach, dd * (kk - 1) // 2)
    return reach


def _device(stages: Sequence[Stage]) -> torch.device:
    """Where the stages' parameters live (the first stage may hold none: an empty map)."""
    return next((p.device for st in stages for p in st.module.parameters()),
                torch.device("cpu"))


@torch.no_grad()
def plan_stages(stages: Sequence[Stage], in_channels: int, align: int) -> StagePlan:
    """Strides and channels of every map, what each stage holds, and each stage's halo.

    Two small forwards find what each stage holds at most per pixel of its window.
    """
    device = _device(stages)
    maps, small = _plan_forward(stages, in_channels, 2 * align, device)
    _, large = _plan_forward(stages, in_channels, 4 * align, device)
    # what each stage holds grows with its window: per image pixel, in floats
    holds = tuple(max(b - a, 0) / 4 / (12 * align * align)
                  for a, b in zip(small, large, strict=True))
    strides = tuple(2 * align // m.shape[-1] for m in maps)
    channels = tuple(int(m.shape[1]) for m in maps)
    fps, used = [], []
    for st in stages:
        a = max([st.stride] + [strides[i] for i in st.inputs])
        halo, u = stage_halo(st.module, [strides[i] for i in st.inputs],
                             [channels[i] for i in st.inputs], st.stride, a)
        fps.append(Footprint(halo, a))
        used.append(u)
    return StagePlan(strides, channels, tuple(fps), tuple(used), holds)


def _plan_forward(stages: Sequence[Stage], in_channels: int, size: int, device: torch.device
                  ) -> tuple[list[Tensor], list[int]]:
    """Every map of a ``size`` x ``size`` image, and the bytes each stage held at most."""
    maps = [torch.zeros(1, in_channels, size, size, device=device)]
    peaks = []
    for st in stages:
        with LiveMemory() as mem:
            maps.append(st.module([maps[i] for i in st.inputs]))
        peaks.append(mem.peak)
    return maps, peaks


def _stage_grid(height: int, width: int, fp: Footprint, floats_per_pixel: float,
                budget: int) -> TileGrid:
    """The stage's grid: one tile when it fits ``budget`` floats, else tiles that do."""
    side = math.isqrt(int(budget / max(floats_per_pixel, 1e-9)))
    if side >= max(height, width):
        return make_grid(height, width, fp, q=1)
    # a core at least twice the context (E <= 4), even past the budget: thinner cores
    # would recompute the halo many times over
    side = max(side // fp.align * fp.align, 4 * fp.context + fp.align)
    if side >= max(height, width):
        return make_grid(height, width, fp, q=1)
    return make_grid(height, width, fp, tile_size=side)


def _tiles(maps: list[Map], st: Stage, k: int, plan: StagePlan, grid: TileGrid,
           channels_last: bool, device: torch.device) -> Iterator[tuple[Tile, list[Tensor]]]:
    for tile in grid:
        yield tile, _windows(maps, st, plan.strides, tile, channels_last, device,
                             plan.used[k])


@torch.no_grad()
def _run_stage(maps: list[Map], st: Stage, k: int, plan: StagePlan, budget: int,
               channels_last: bool, autocast: torch.dtype | None, device: torch.device,
               store: Path | None) -> tuple[Map, TileGrid]:
    height, width = maps[0].shape[-2:]
    inputs = sum(plan.channels[i] / plan.strides[i] ** 2 for i, u in zip(
        st.inputs, plan.used[k], strict=True) if u)
    output = plan.channels[k + 1] / st.stride ** 2
    fpp = inputs + max(output, plan.holds[k] if plan.holds else 0.0)
    grid = _stage_grid(height, width, plan.footprints[k], fpp, budget)
    s = st.stride
    out: Tensor | DiskMap | None = None

    def tiles() -> Iterator[tuple[Tile, list[Tensor]]]:
        return _tiles(maps, st, k, plan, grid, channels_last, device)

    fixed = fixed_statistics(st.module, tiles, grid) if (
        len(grid) > 1 and has_statistics(st.module)) else contextlib.nullcontext()
    core_only = bool(getattr(st.module, "computes_core", False))
    # the passes under the same autocast: a map the stage before wrote in bf16 feeds both
    with torch.autocast(device.type, dtype=autocast or torch.float32,
                        enabled=autocast is not None), fixed:
        for tile, xs in tiles():
            c, cr = tile.core, tile.crop
            crop = (slice(cr.row // s, cr.row_end // s), slice(cr.col // s, cr.col_end // s))
            rd = tile.read
            edges = (rd.row == 0, rd.row_end == height, rd.col == 0, rd.col_end == width)
            y = st.module(xs, core=crop, edges=edges) if core_only else st.module(xs)
            if out is None:
                shape = (y.shape[0], y.shape[1], height // s, width // s)
                if store is not None:
                    out = DiskMap(store / f"map{k + 1}.bin", shape, y.dtype)
                else:
                    out = torch.empty(shape, dtype=y.dtype, memory_format=torch.channels_last
                                      if channels_last else torch.contiguous_format)
            rows, cols = slice(c.row // s, c.row_end // s), slice(c.col // s, c.col_end // s)
            core = (y if core_only else y[..., crop[0], crop[1]]).cpu()
            if isinstance(out, DiskMap):
                out.write(rows, cols, core)
            else:
                out[..., rows, cols] = core
    assert out is not None
    return out, grid


def predict_staged(stages: Sequence[Stage], image: Tensor, *, align: int,
                   budget: int = 1 << 27, plan: StagePlan | None = None,
                   channels_last: bool = False, autocast: torch.dtype | None = None,
                   store: str | Path | None = None, efficiency: list[float] | None = None
                   ) -> Tensor:
    """Logits ``[B, K, H, W]`` of the staged network, equal to its untiled forward.

    Args:
        stages: the network as stages (e.g. :func:`seg_at_scale.models.smp_stage_split.smp_stages`).
        image: ``[B, C, H, W]``, normalised; extended to a multiple of ``align`` as
            ``predict_full`` extends it.
        align: the network's downsampling factor.
        budget: floats one stage tile may hold, its input windows and what its forward
            holds at once (2**27: 512 MB; the plan's ``holds``).
        plan: from :func:`plan_stages` (found here when omitted).
        channels_last: maps and tiles in NHWC (faster convolutions on CPU).
        autocast: run stages under ``torch.autocast`` with this dtype (the fast path).
        store: a folder for the maps between stages (:class:`DiskMap` files in a temporary
            folder under it, removed at the end): the process then holds one stage tile's
            windows, not whole maps. ``None`` keeps them in memory.
        efficiency: when a list, each stage's E is appended to it (1.0: no halo overhead).
    """
    height, width = image.shape[-2:]
    folder = Path(tempfile.mkdtemp(prefix="staged-", dir=store)) if store is not None else None
    try:
        with staged_maps(stages, extend(image, Footprint(0, align)), align=align,
                         budget=budget, plan=plan, channels_last=channels_last,
                         autocast=autocast, folder=folder, efficiency=efficiency) as logits:
            return read_map(logits, slice(0, height), slice(0, width)).float().contiguous()
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def staged_maps(stages: Sequence[Stage], image: Map, *, align: int, budget: int = 1 << 27,
                plan: StagePlan | None = None, channels_last: bool = False,
                autocast: torch.dtype | None = None, folder: Path | None = None,
                efficiency: list[float] | None = None) -> Iterator[Map]:
    """Run the stages over ``image`` (extended already); yields the last map, the logits.

    As :func:`predict_staged`, for callers that read the logits by window (the raster
    path): with ``folder`` (an existing folder, the caller's) every map, the logits
    included, is a :class:`DiskMap` file in it, each removed when no longer needed and all
    of them when the block ends, normally or not.
    """
    large_tensors_mapped()
    plan = plan or plan_stages(stages, image.shape[1], align)
    give_back_heap()  # the probes' float64 copies
    device = _device(stages)
    maps: list[Map] = [image]
    last = plan.last_reads(stages)
    try:
        for k, st in enumerate(stages):
            out, grid = _run_stage(maps, st, k, plan, budget, channels_last, autocast,
                                   device, folder)
            maps.append(out)
            if efficiency is not None:
                efficiency.append(grid.efficiency)
            for i in range(len(maps) - 1):  # keep only the shape of maps no stage reads now
                if last.get(i, -1) <= k and not _shape_only(maps[i]):
                    maps[i] = _drop(maps[i])
            give_back_heap()
        yield maps[-1]
    finally:
        for m in maps:
            if isinstance(m, DiskMap):
                m.close()


def _drop(m: Map) -> Tensor:
    """A map reduced to its shape (stride 0: no memory), its file removed."""
    if isinstance(m, DiskMap):
        m.close()
        return torch.zeros((), dtype=m.dtype).expand(m.shape)
    if isinstance(m, Tensor):
        return m.new_zeros(()).expand(m.shape)
    return torch.zeros(()).expand(m.shape)  # a map read by window: nothing to free
