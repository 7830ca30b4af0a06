"""The one tile engine: window source + grid + batches -> (tile, core output).

Every prediction path walks tiles through this module: in-memory tensors
(:func:`seg_at_scale.tiling.predict_tiled`), raster files
(:mod:`seg_at_scale.prediction`), and each of the transforms of exact test-time
augmentation. A *window source* answers ``read(window) -> (input [C, h, w], no-data mask)``
with the model's fill rule applied outside the image (:func:`~.geometry.fill_of`).

Batches are planned from the grid alone (consecutive tiles of one input size), never from
which process runs them or which tiles are left after a resume: a batch is computed the
same way wherever and whenever it runs, so outputs are byte-identical under any number of
processes and after any interruption.

>>> from seg_at_scale.tiling.geometry import Footprint, make_grid
>>> grid = make_grid(100, 172, Footprint(halo=5, align=4), tile_size=48, uniform=True)
>>> grid.shape, [len(b.tiles) for b in plan_batches(grid.tiles, 3)][:6]
((4, 6), [1, 3, 1, 1, 1, 3])
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from seg_at_scale.tiling.geometry import (
    Footprint,
    Tile,
    Window,
    cover,
    fill_of,
    inside,
    source_indices,
)

__all__ = ["WindowSource", "TensorWindows", "Batch", "plan_batches", "count_batches", "size_runs",
           "D4", "TTA", "run_batches", "run_parts", "Part", "PartError", "BatchOutput",
           "forward_shapes"]


class WindowSource(Protocol):
    """Model inputs by window (image coordinates, may reach outside), in two halves.

    ``load`` runs on the engine's reader thread (for an accelerator; between the forwards
    on the CPU) and should only read; ``prepare`` runs on
    the model's thread (after the copy to its device), where torch's threads do the
    arithmetic without competing with them.
    """

    def load(self, window: Window) -> tuple[Any, np.ndarray | None]:
        """Raw window ``[C, h, w]`` or ``[B, C, h, w]`` (numpy or tensor), no-data mask."""
        ...

    def prepare(self, raws: list[Tensor], keeps: list[tuple[slice, slice]],
                channels_last: bool) -> Tensor:
        """The model input ``[n, C, h, w]`` of equal-size raw windows ``[B, C, h, w]``.

        ``n`` is their B summed; ``keeps`` are the parts inside the image in each window's
        frame (for the fill rule).
        """
        ...


def read_window(image: Tensor, window: Window, fp: Footprint) -> Tensor:
    """Crop ``[..., H, W]`` to ``window`` (image coordinates), extending as ``fp`` says."""
    h, w = image.shape[-2:]
    if window.row >= 0 and window.col >= 0 and window.row_end <= h and window.col_end <= w:
        return image[..., window.row : window.row_end, window.col : window.col_end]
    rows = source_indices(window.row, window.height, h, fill_of(fp))
    cols = source_indices(window.col, window.width, w, fill_of(fp))
    r, c = torch.from_numpy(rows.clip(0)), torch.from_numpy(cols.clip(0))
    out = image.index_select(-2, r.to(image.device)).index_select(-1, c.to(image.device))
    if fp.padding == "same":
        keep = torch.from_numpy((rows >= 0)[:, None] & (cols >= 0)[None, :]).to(image.device)
        out = out * keep.to(out.dtype)
    return out


@dataclass
class TensorWindows:
    """Windows of an in-memory, already normalised ``[B, C, H, W]`` tensor."""

    image: Tensor
    fp: Footprint

    def load(self, window: Window) -> tuple[Tensor, None]:
        return read_window(self.image, window, self.fp), None

    def prepare(self, raws: list[Tensor], keeps: list[tuple[slice, slice]],
                channels_last: bool) -> Tensor:
        x = torch.cat(raws)  # already the model's input, filled outside
        return x.contiguous(memory_format=torch.channels_last) if channels_last else x


@dataclass(frozen=True)
class Batch:
    """Tiles run in one forward pass; ``index`` is the batch's place in the plan."""

    index: int
    tiles: tuple[Tile, ...]


def plan_batches(tiles: Sequence[Tile], batch_size: int) -> list[Batch]:
    """Consecutive runs of tiles with one input size, at most ``batch_size`` each.

    The grouping rule is :func:`size_runs`'s: a batch never mixes input sizes and a run of
    one size is cut into ``batch_size`` pieces from its start.
    """
    _check_batch_size(batch_size)
    out: list[Batch] = []
    start = 0
    for _, n in size_runs(((t.read.height, t.read.width), 1) for t in tiles):
        for k in range(start, start + n, batch_size):
            out.append(Batch(len(out), tuple(tiles[k : min(k + batch_size, start + n)])))
        start += n
    return out


def count_batches(runs: Iterable[tuple[tuple[int, int], int]], batch_size: int) -> int:
    """How many batches :func:`plan_batches` makes, without the tiles.

    ``runs``: the tiles as ``(input size, count)`` pieces in grid order (a grid of the
    smallest tiles of a network of a few pixels of halo holds millions).
    """
    _check_batch_size(batch_size)
    return sum(-(-n // batch_size) for _, n in size_runs(runs))


def size_runs(runs: Iterable[tuple[tuple[int, int], int]],
              ) -> Iterator[tuple[tuple[int, int], int]]:
    """The maximal runs of one input size: consecutive ``(size, count)`` pieces joined.

    The batches' grouping rule, in one place for :func:`plan_batches` and
    :func:`count_batches`.
    """
    run: tuple[tuple[int, int], int] | None = None
    for size, n in runs:
        if run is not None and run[0] == size:
            run = (size, run[1] + n)
            continue
        if run is not None:
            yield run
        run = (size, n)
    if run is not None:
        yield run


def _check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: use at least 1")


@dataclass(frozen=True)
class D4:
    """One element of the dihedral group of the square: transpose, then flips.

    >>> g = D4(True, True, False)
    >>> x = np.arange(6).reshape(2, 3)
    >>> np.array_equal(g.invert(g.apply(x)), x)
    True
    >>> g.to_source(Window(0, 0, 1, 2), 2, 3)  # a window of g(x) (3 x 2) in x's frame
    Window(row=0, col=2, height=2, width=1)
    """

    transpose: bool = False
    flip_rows: bool = False
    flip_cols: bool = False

    def shape(self, height: int, width: int) -> tuple[int, int]:
        """Size of the transformed image."""
        return (width, height) if self.transpose else (height, width)

    def apply(self, x: Any) -> Any:
        """Transform the last two axes of an array or tensor."""
        if self.transpose:
            x = x.transpose(-1, -2) if isinstance(x, Tensor) else np.swapaxes(x, -1, -2)
        return _flip(x, self.flip_rows, self.flip_cols)

    def invert(self, x: Any) -> Any:
        """Undo :meth:`apply`."""
        x = _flip(x, self.flip_rows, self.flip_cols)
        if self.transpose:
            x = x.transpose(-1, -2) if isinstance(x, Tensor) else np.swapaxes(x, -1, -2)
        return x

    def to_source(self, w: Window, height: int, width: int) -> Window:
        """The window of the source image that ``w`` (transformed frame) shows."""
        th, tw = self.shape(height, width)
        r = th - w.row_end if self.flip_rows else w.row
        c = tw - w.col_end if self.flip_cols else w.col
        return Window(c, r, w.width, w.height) if self.transpose else Window(r, c, w.height,
                                                                              w.width)

    def from_source(self, w: Window, height: int, width: int) -> Window:
        """Where the source window ``w`` lands in the transformed frame."""
        if self.transpose:
            w = Window(w.col, w.row, w.width, w.height)
        th, tw = self.shape(height, width)
        r = th - w.row_end if self.flip_rows else w.row
        c = tw - w.col_end if self.flip_cols else w.col
        return Window(r, c, w.height, w.width)


def _flip(x: Any, rows: bool, cols: bool) -> Any:
    dims = tuple(d for d, f in ((-2, rows), (-1, cols)) if f)
    if not dims:
        return x
    return torch.flip(x, dims) if isinstance(x, Tensor) else np.flip(x, dims)


#: Exact test-time augmentation: ``None`` (identity), the 4 flips, or all 8 of D4.
TTA = {
    None: (D4(),),
    "flips": tuple(D4(False, r, c) for r in (False, True) for c in (False, True)),
    "d4": tuple(D4(t, r, c) for t in (False, True) for r in (False, True) for c in (False, True)),
}


@dataclass
class BatchOutput:
    """One batch's result: per tile, the core output ``[K, h, w]`` on the model's device.

    ``outputs`` are logits without TTA and mean softmax probabilities with it
    (``probabilities`` tells which); ``invalid`` are the cores' no-data masks (or None);
    ``part`` is the index of the batch's :class:`Part` (0 for :func:`run_batches`).
    """

    batch: Batch
    outputs: list[Tensor]
    invalid: list[np.ndarray | None]
    probabilities: bool
    part: int = 0


@dataclass(frozen=True)
class Part:
    """Batches of one image: its window source, its size and the model's footprint.

    ``on_read(read_s, waited_s)`` is told, per batch, how long reading it took (on the
    reader thread) and how long the model waited for it.
    """

    source: WindowSource
    batches: Sequence[Batch]
    height: int
    width: int
    fp: Footprint
    on_read: Callable[[float, float], None] | None = None


class PartError(Exception):
    """Work on a :class:`Part` failed: ``part`` says which, ``cause`` why.

    Raised for a failed read here, and for a failed write of its outputs by
    :func:`seg_at_scale.prediction.raster.predict_scenes`.
    """

    def __init__(self, part: int, cause: BaseException) -> None:
        super().__init__(f"part {part}: {cause}")
        self.part, self.cause = part, cause


def run_batches(model: Callable[[Tensor], Any], source: WindowSource, batches: Sequence[Batch], *,
                height: int, width: int, fp: Footprint, device: torch.device,
                autocast: torch.dtype | None = None, channels_last: bool = False,
                tta: str | None = None, on_read: Callable[[float, float], None] | None = None,
                ) -> Iterator[BatchOutput]:
    """Run ``batches`` of one image through ``model`` (:func:`run_parts` with one part)."""
    try:
        yield from run_parts(model, [Part(source, batches, height, width, fp, on_read)],
                             device=device, autocast=autocast, channels_last=channels_last,
                             tta=tta)
    except PartError as exc:
        raise exc.cause from None


def run_parts(model: Callable[[Tensor], Any], parts: Sequence[Part], *, device: torch.device,
              autocast: torch.dtype | None = None, channels_last: bool = False,
              tta: str | None = None) -> Iterator[BatchOutput]:
    """Run the batches of every part (image) in turn, reading the next batch while one runs.

    The next batch may be the next part's first: an archive's scenes follow one another
    without the device waiting for a scene's first read. On the CPU the next batch is read
    between the forwards instead of on a thread: the network's threads already take every
    core, and a reader beside them only competes for the cores (on the 8192^2 scene of
    ``experiments/bench_feed.py`` its decoding took 1.6 s instead of 0.9 s, and the file
    path was as fast or faster without it). On CUDA the reader thread stages each batch in
    pinned memory and copies it on a side stream, so the copy of batch k+1 overlaps the
    model on batch k; the model's stream waits on an event, never on the host. A failed
    read is raised as :class:`PartError` naming its part, when that batch's turn comes.
    """
    if tta not in TTA:
        raise ValueError(f"tta={tta!r}: use null, 'flips' or 'd4'")
    views = TTA[tta]
    jobs = [(k, b, g) for k, part in enumerate(parts) for b in part.batches for g in views]
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    ctx = (torch.autocast(device.type, dtype=autocast) if autocast is not None
           else contextlib.nullcontext())

    def load(job: tuple[int, Batch, D4]) -> tuple[Any, ...]:
        k, batch, g = job
        part = parts[k]
        try:
            return _load(part.source, (batch, g), part.height, part.width, part.fp, device,
                         stream)
        except Exception as exc:
            raise PartError(k, exc) from exc

    acc: list[Tensor] = []
    masks: list[np.ndarray | None] = []
    reader: Executor = _Inline() if device.type == "cpu" else ThreadPoolExecutor(1)
    with reader as pool, torch.inference_mode(), ctx:
        pending = pool.submit(load, jobs[0]) if jobs else None
        for n, (k, batch, g) in enumerate(jobs):
            assert pending is not None
            t0 = time.perf_counter()
            groups, invalid, event, seconds = pending.result()
            pending = pool.submit(load, jobs[n + 1]) if n + 1 < len(jobs) else None
            waited = time.perf_counter() - t0  # on the CPU: the next batch's read too
            told = parts[k].on_read
            if told is not None:
                told(seconds, waited)
            if event is not None:
                torch.cuda.current_stream(device).wait_event(event)
            cores = _forward(model, parts[k].source, groups, g, tta is not None,
                             len(batch.tiles), channels_last)
            if g == views[0]:  # the identity: its no-data masks are the tiles'
                acc, masks = cores, invalid
            else:
                acc = [a + c for a, c in zip(acc, cores, strict=True)]
            if g == views[-1]:
                outs = acc if tta is None else [a / len(views) for a in acc]
                yield BatchOutput(batch, outs, masks, tta is not None, k)


class _Inline(Executor):
    """An executor that runs each job as it is submitted, in the calling thread."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        done: Future = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # raised where the result is taken, as a thread's is
            done.set_exception(exc)
        return done


def _load(source: WindowSource, job: tuple[Batch, D4], height: int, width: int,
          fp: Footprint, device: torch.device, stream: Any
          ) -> tuple[list[_Group], list[np.ndarray | None], Any, float]:
    """Read a batch's raw windows in the view ``g``, grouped by input size.

    On CUDA they are copied (pinned, on the side stream) to the device.
    """
    t0 = time.perf_counter()
    batch, g = job
    th, tw = g.shape(height, width)
    by_size: dict[tuple[int, int], _Group] = {}
    invalid: list[np.ndarray | None] = []
    for i, (tile, view) in enumerate(zip(batch.tiles, _views(batch, g, height, width, fp),
                                         strict=True)):
        raw, bad = source.load(g.to_source(view.read, height, width))
        x = g.apply(raw if isinstance(raw, Tensor) else _as_tensor(raw))
        grp = by_size.setdefault(tuple(x.shape[-2:]), _Group([], [], [], [], x.dim() == 4))
        grp.index.append(i)
        grp.raws.append(x if x.dim() == 4 else x[None])
        grp.views.append(view)
        grp.keeps.append(inside(view.read, th, tw))
        if g == D4():
            invalid.append(None if bad is None else _core_mask(bad, tile))
    event = None
    if stream is not None:
        for grp in by_size.values():
            # one window (a scene the device takes whole): no copy of it before pinning
            x = grp.raws[0] if len(grp.raws) == 1 else torch.cat(grp.raws)
            if x.device.type != "cpu":  # an image already on the device: nothing to copy
                grp.raws = list(x.to(device).split([r.shape[0] for r in grp.raws]))
                continue
            x = x.pin_memory()  # raw samples: uint8 is 4x fewer bytes
            with torch.cuda.stream(stream):
                grp.raws = list(x.to(device, non_blocking=True).split(
                    [r.shape[0] for r in grp.raws]))
        event = torch.cuda.Event()
        event.record(stream)
    elif device.type != "cpu":  # another accelerator: a plain copy
        for grp in by_size.values():
            grp.raws = [r.to(device) for r in grp.raws]
    return list(by_size.values()), invalid, event, time.perf_counter() - t0


def _as_tensor(raw: np.ndarray) -> Tensor:
    """``raw`` as a tensor over its memory and in its layout.

    Copied (in the same layout) only where torch cannot share it: read-only, or with
    negative strides. An interleaved file's window keeps its ``[h, w, C]`` memory
    (:meth:`seg_at_scale.data.windows.RasterWindows.load`), which casts into a
    channels-last batch without reordering.
    """
    if not raw.flags.writeable or any(s < 0 for s in raw.strides):
        raw = np.array(raw, order="K")
    return torch.from_numpy(raw)


def _views(batch: Batch, g: D4, height: int, width: int, fp: Footprint) -> list[Tile]:
    """The tiles of ``batch`` as the view ``g`` reads them (in the transformed frame)."""
    th, tw = g.shape(height, width)
    return [cover(g.from_source(tile.core, height, width), th, tw, fp) for tile in batch.tiles]


def forward_shapes(batches: Sequence[Batch], *, height: int, width: int, fp: Footprint,
                   tta: str | None = None) -> Counter[tuple[int, int, int]]:
    """How many forwards :func:`run_batches` makes per input shape ``(tiles, h, w)``.

    For windows of one image each (a raster's tiles); a batch's tiles of one size are one
    forward, as ``run_batches`` groups them.
    """
    shapes: Counter[tuple[int, int, int]] = Counter()
    for batch in batches:
        for g in TTA[tta]:
            sizes = Counter((v.read.height, v.read.width)
                            for v in _views(batch, g, height, width, fp))
            shapes.update((n, h, w) for (h, w), n in sizes.items())
    return shapes


@dataclass
class _Group:
    """Tiles of one batch with one input size: raw windows ``[B, C, h, w]`` each."""

    index: list[int]
    raws: list[Tensor]
    views: list[Tile]
    keeps: list[tuple[slice, slice]]
    batched: bool


def _core_mask(bad: np.ndarray, tile: Tile) -> np.ndarray:
    r, c = tile.core.row - tile.read.row, tile.core.col - tile.read.col
    return bad[r : r + tile.core.height, c : c + tile.core.width]


def _forward(model: Callable[[Tensor], Any], source: WindowSource, groups: list[_Group], g: D4,
             softmax: bool, n: int, channels_last: bool) -> list[Tensor]:
    """Core outputs per tile (``[K, h, w]``, or ``[B, K, h, w]`` when batched), source frame."""
    out: list[Tensor] = [torch.empty(0)] * n
    for grp in groups:
        if grp.raws[0].is_cuda:
            for raw in grp.raws:
                raw.record_stream(torch.cuda.current_stream(raw.device))
        y = model(source.prepare(grp.raws, grp.keeps, channels_last))
        if softmax:
            y = torch.softmax(y.float(), dim=1)
        per = y.shape[0] // len(grp.index)
        for k, (i, view) in enumerate(zip(grp.index, grp.views, strict=True)):
            c = view.crop
            core = g.invert(y[k * per : (k + 1) * per, :, c.row : c.row_end, c.col : c.col_end])
            out[i] = core if grp.batched else core[0]
    return out
