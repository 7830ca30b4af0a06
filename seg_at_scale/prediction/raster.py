"""Whole-raster prediction at any scale: one process or many, resumable, zarr or COG out.

``predict_raster(model, "scene.tif", "mask.tif", options)`` walks the tiles of a uniform grid
through the tile engine (:mod:`seg_at_scale.tiling.engine`) and writes each tile's core
into a Zarr store whose chunks are those cores (:mod:`.store`). Under ``torch.distributed``
(``seg-predict processes=N``, or a multi-node launch) every rank takes its share of the
grid's batches and writes its chunks directly; rank 0 finalises. Exact crops need no
blending, and batches are fixed by the grid alone, so the output is byte-identical for
any number of processes and after any interruption: a killed run rerun with the same
arguments recomputes only the batches whose chunks are missing.

Output by extension: the tiles go to a hidden working store beside the output
(:func:`~.checks.store_path`). A ``.zarr`` output is that store, renamed to the output's
name once complete (readable by xarray); a ``.tif`` / ``.tiff`` output is a Cloud-Optimized
GeoTIFF finalised from it (the store removed when the COG is complete).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.data.windows import RasterWindows
from seg_at_scale.errors import SegAtScaleError
from seg_at_scale.io import RasterReader
from seg_at_scale.parallel.launch import barrier, rank_world
from seg_at_scale.prediction.checks import (
    check_outputs,
    most_batches,
    store_path,
    too_many_ranks,
)
from seg_at_scale.prediction.compile_choice import checked_network
from seg_at_scale.prediction.finalize import RowsOnDisk, finalize
from seg_at_scale.prediction.lock import output_lock
from seg_at_scale.prediction.options import PredictOptions
from seg_at_scale.prediction.outputs import output_kind
from seg_at_scale.prediction.plan import (
    drop_working_store,
    model_digest,
    open_store,
    output_channels,
    plan_raster,
    prediction_network,
    readable_input_id,
    reusable,
    with_tile,
)
from seg_at_scale.prediction.progress import progress_bar
from seg_at_scale.prediction.staged_raster import check_staged, plan_staged, predict_staged_raster
from seg_at_scale.prediction.store import NODATA, PredictionStore
from seg_at_scale.tiling import Footprint, TileGrid, footprint
from seg_at_scale.tiling.engine import (
    Batch,
    BatchOutput,
    Part,
    PartError,
    forward_shapes,
    run_parts,
)
from seg_at_scale.tiling.geometry import fill_of
from seg_at_scale.tiling.halo import check_footprint
from seg_at_scale.tiling.predict import refuse_training_norms
from seg_at_scale.tiling.statistic_passes import (
    check_no_tta,
    fixed_statistics,
    has_statistics,
    source_tiles,
)
from seg_at_scale.tiling.statistics import (
    ImagePooled,
    feature_count,
    image_pool_sum_of,
    uses_image_pool,
)

__all__ = ["PredictionStats", "predict_raster", "predict_scenes", "SceneWork", "on_rank0",
           "scene_tile"]


@dataclass
class PredictionStats:
    """What a prediction run did, and where its time went (seconds, this process).

    ``read_s`` is spent reading the tiles' raw windows: on a GPU on a background thread,
    overlapped with the model, on the CPU between the forwards (``read_wait_s``: how long
    the model waited for it; normalising is model time); ``model_s`` is the main thread's
    time in the forward passes and turning logits into outputs (on a GPU: queueing them,
    which waits for nothing on the device); ``write_s`` how long it waited for the
    background chunk writer (on a GPU this includes the device finishing the batch before);
    ``finalize_s`` is rank 0's COG (or store) finalisation after the last tile (in one
    process it runs beside the tiles, :func:`finalize_beside`: what is left of it then);
    ``statistics_s`` the first pass of a model with whole-image statistics.
    ``tiles_computed`` counts this process's tiles (a resumed run skips the batches already
    on disk: ``tiles_resumed``). ``class_pixels`` (rank 0) holds the output's pixels per
    class of the model, no data not counted.
    """

    path: Path
    height: int
    width: int
    tiles: int
    efficiency: float
    processes: int = 1
    batches: int = 0
    tiles_computed: int = 0
    tiles_resumed: int = 0
    read_s: float = 0.0
    read_wait_s: float = 0.0
    model_s: float = 0.0
    write_s: float = 0.0
    finalize_s: float = 0.0
    total_s: float = 0.0
    statistics_s: float = 0.0
    class_pixels: list[int] = field(default_factory=list)
    store: str = ""
    reused: bool = False  # a finished output of this very prediction was found: kept

    @property
    def mpix_per_s(self) -> float:
        return self.height * self.width / 1e6 / max(self.total_s, 1e-9)


def predict_raster(model: nn.Module, image: str | os.PathLike[str], output: str | os.PathLike[str],
                   options: PredictOptions | None = None, *, fp: Footprint | None = None,
                   normalizer: Normalizer | None = None,
                   class_names: Sequence[str] | None = None,
                   exact: bool = True) -> PredictionStats:
    """Predict class labels (and optionally probabilities) for a whole raster file.

    Args:
        model: network in eval mode, on the device it should run on.
        image: input raster path.
        output: ``.tif`` (COG) or ``.zarr``; see the module docstring.
        options: tiles, precision, TTA, probabilities, resume, ... (:class:`PredictOptions`;
            the default is the exact fp32 path with ``tile_size=auto``: the largest tile
            the device holds, or the whole image as one).
        fp: footprint; computed from the model when omitted.
        normalizer: raw samples to model input; defaults to ``x / 255``.
        class_names: written into the store's attributes and the COG band descriptions.
        exact: False for a model trained with ``tiling.exact=false`` (approximate
            footprint): recorded in the fingerprint and the COG's ``TILING`` tag.

    Returns:
        :class:`PredictionStats` of this process (class histogram on rank 0).
    """
    o = options or PredictOptions()
    refuse_training_norms(model, "predict_raster")
    check_no_tta(model, o.tta)
    t_start = time.perf_counter()
    out_path, image = Path(output), Path(image)
    output_kind(out_path)
    rank, world = rank_world()
    check_outputs({"output": out_path, "working store": store_path(out_path)},
                  {"image": image}, overwrite=True)  # existing outputs: open_store
    if exact:
        check_footprint(model, fp, "predict_raster")
    fp = fp or footprint(model)
    device = next(model.parameters()).device
    norm = normalizer or Normalizer()
    o = scene_tile(o, model, fp, image, world)
    plan = plan_raster(image, out_path, o, fp=fp, normalizer=norm,
                       names=_names(model, image, fp, class_names), weights=model_digest(model),
                       device=device, exact=exact,
                       input_hash=on_rank0(lambda: readable_input_id(Path(image))))
    with plan.reader:  # the input file closed however the prediction ends
        # one channel per class (or refused), its BatchNorm folded
        model = prediction_network(model, o, plan.reader.bands, fp, plan.num_classes)
        stages = check_staged(model, o, world) if o.staged else None  # or refused, before work
        grid, batches = plan.grid, plan.batches
        if world > len(batches):
            raise agreed(too_many_ranks(world, image, len(batches), len(grid), most_batches(
                grid.height, grid.width, fp, o.batch_size)))
        stats = PredictionStats(out_path, grid.height, grid.width, len(grid), grid.efficiency,
                                processes=world, store=str(plan.working))
        lock = output_lock(out_path) if rank == 0 else contextlib.nullcontext()
        with lock:
            reused = on_rank0(lambda: reusable(plan, o.overwrite))
            if reused is not None:  # this very prediction finished before: nothing to compute
                on_rank0(lambda: drop_working_store(plan, o.keep_store))
                stats.tiles_resumed, stats.class_pixels, stats.reused = len(grid), reused, True
                stats.total_s = time.perf_counter() - t_start
                return stats
            # the stage plan and its disk check: after the reuse check (a finished output is
            # reported on a full disk too) and before the store (refused before any work)
            stage_plan = (plan_staged(stages, grid, plan.reader.bands, out_path, o)
                          if stages is not None else None)
            opened: list[PredictionStore] = []
            on_rank0(lambda: opened.append(open_store(plan, o)))
            store = opened[0] if rank == 0 else PredictionStore.attach(plan.working)
            todo = [b for b in batches if not all(store.done(t) for t in b.tiles)]
            barrier()  # nobody writes before every rank has listed what is left
            stats.tiles_resumed = len(grid) - sum(len(b.tiles) for b in todo)
            mine = todo[rank::world]
            stats.batches = len(mine)
            source = RasterWindows(plan.reader, norm, fill_of(fp))
            show = o.progress if o.progress is not None else not os.environ.get("CI")

            def finish(ready: RowsOnDisk | None = None) -> list[int]:
                return finalize(store, out_path, plan.kind, plan.reader, plan.names,
                                o.probabilities, o.overwrite, o.keep_store, ready=ready)

            # one process: its own writes wake the COG's writer, and the poll is a fallback;
            # with ranks it also looks every 20 ms for the chunks the others write
            ready = (RowsOnDisk(store, poll_s=0.02 if world > 1 else 0.5)
                     if rank == 0 and finalize_beside(stages) else None)
            if ready is not None:
                store.watch(ready.wrote)
            with ThreadPoolExecutor(1, thread_name_prefix="finalize") as finisher:
                finishing = finisher.submit(finish, ready) if ready is not None else None
                try:
                    if stages is not None:
                        _staged(stages, stage_plan, source, grid, todo, store, o, stats, out_path,
                                show)
                    else:
                        pool_ctx = _image_pool(model, source, grid, batches[rank::world], device,
                                               o.autocast, o.channels_last, stats,
                                               show and rank == 0, world)
                        with pool_ctx, progress_bar(sum(len(b.tiles) for b in todo),
                                                    show and rank == 0,
                                                    grid.height * grid.width / len(grid),
                                                    world) as bar:
                            predict_batches(model, source, mine, grid, store, o, stats,
                                            _Watching(bar, finishing))
                    barrier()  # every rank's tiles are on disk
                    if ready is not None:
                        ready.all_written()
                    if rank == 0:
                        t0 = time.perf_counter()
                        stats.class_pixels = finishing.result() if finishing else finish()
                        stats.finalize_s = time.perf_counter() - t0
                except BaseException:
                    if ready is not None:  # its COG's temporary files removed as it stops
                        ready.abort()
                    raise
            barrier()
        stats.total_s = time.perf_counter() - t_start
        return stats


class _Watching:
    """The progress bar, which also stops the tiles once the COG beside them has failed.

    A full disk found by the finalisation (the COG is the largest file written) ends the
    run at the next batch instead of after the last tile; the tiles on disk stay for the
    rerun.
    """

    def __init__(self, bar: Any, finishing: Future | None) -> None:
        self.bar, self.finishing = bar, finishing

    def update(self, n: int) -> None:
        self.bar.update(n)
        if self.finishing is not None and self.finishing.done():
            error = self.finishing.exception()
            if error is not None:
                raise error


def finalize_beside(stages: list[Any] | None) -> bool:
    """Whether the COG is written beside the tiles (:class:`~.finalize.RowsOnDisk`).

    Any number of ranks, not staged: rank 0 writes each row band once every rank's chunks
    of it are on disk. On a GPU the host's cores are free while the device computes, and
    the finalisation after the last tile took as long as the network (``bench_gpu.py``); on
    the CPU the work is the same, done earlier (``bench_finalize_beside.py``: as fast with
    every core taken by the network, faster with one free), and with several ranks the
    others no longer wait while rank 0 finalises. A staged prediction finalises after its
    last stage.
    """
    return stages is None


def _staged(stages: list[Any], plan: Any, source: RasterWindows, grid: TileGrid,
            todo: list[Batch], store: PredictionStore, o: PredictOptions,
            stats: PredictionStats, out: Path, show: bool) -> None:
    """``staged=true``: the logits stage by stage, the tiles the store lacks written."""
    with progress_bar(sum(len(b.tiles) for b in todo), show,
                      grid.height * grid.width / len(grid), 1) as bar:
        predict_staged_raster(stages, plan, source, grid, todo, store, o, stats, out, bar,
                              lambda y, invalid: tile_output(y, invalid, o.probabilities))


def _image_pool(model: nn.Module, source: RasterWindows, grid: TileGrid, share: list[Batch],
                device: torch.device, autocast: torch.dtype | None, channels_last: bool,
                stats: PredictionStats, show: bool, world: int
                ) -> contextlib.AbstractContextManager[Any]:
    """Pass 1 of a model with a whole-image statistic: fix its pooled mean for pass 2.

    Every tile counts, also on a resumed run: each rank sums the core features of its share
    of all batches in float64, and the all-reduced sum over the whole image's feature count
    is the mean one process would compute. A grid of one tile needs no pass: that tile is
    the whole (extended) image, whose own statistics are the untiled forward's.
    """
    if len(grid) == 1:
        return contextlib.nullcontext()
    if has_statistics(model):  # GroupNorm-like sites (FPN): the passes of tiling.statistic_passes
        return _statistic_passes(model, source, grid, share, device, stats, world)
    if not (isinstance(model, ImagePooled) and uses_image_pool(model)):  # the same test
        return contextlib.nullcontext()
    t0 = time.perf_counter()

    def inputs(bar: Any) -> Iterator[tuple[Any, Tensor]]:
        for batch in share:
            for tile in batch.tiles:
                x = torch.from_numpy(source.read(tile.read)[0]).unsqueeze(0)
                yield tile, (x.contiguous(memory_format=torch.channels_last)
                             if channels_last else x)
                bar.update(1)

    ctx = (torch.autocast(device.type, dtype=autocast) if autocast is not None
           else contextlib.nullcontext())
    with torch.inference_mode(), ctx, progress_bar(len(grid), show, grid.height * grid.width
                                                   / len(grid), world, "pass 1") as bar:
        total, dtype = image_pool_sum_of(model, inputs(bar))
    if rank_world()[1] > 1:
        dist.all_reduce(total)
    pooled = (total / feature_count(model, grid)).to(dtype)
    stats.statistics_s = time.perf_counter() - t0
    return model.fixed_image_pool(pooled)


@contextlib.contextmanager
def _statistic_passes(model: nn.Module, source: RasterWindows, grid: TileGrid,
                      share: list[Batch], device: torch.device, stats: PredictionStats,
                      world: int) -> Iterator[None]:
    """The statistic passes over this rank's share of every batch (all-reduced sums)."""
    tiles = source_tiles(source, [t for batch in share for t in batch.tiles], device)

    def reduce(total: Tensor) -> Tensor:
        dist.all_reduce(total)
        return total

    t0 = time.perf_counter()
    with fixed_statistics(model, tiles, grid, reduce=reduce if world > 1 else None):
        stats.statistics_s = time.perf_counter() - t0
        yield


def predict_batches(model: nn.Module, source: RasterWindows, mine: list[Batch],
                    grid: TileGrid, store: PredictionStore, options: PredictOptions,
                    stats: PredictionStats, bar: Any, net: Any = None) -> None:
    """Run this rank's batches of one raster (:func:`predict_scenes` with one scene)."""
    try:
        predict_scenes(model, [SceneWork(source, mine, grid, store, stats)], options, bar,
                       net=net)
    except PartError as exc:
        raise exc.cause from None


@dataclass
class SceneWork:
    """One raster's share of a run: its windows, its batches, its store and its figures."""

    source: RasterWindows
    batches: list[Batch]
    grid: TileGrid
    store: PredictionStore
    stats: PredictionStats


def predict_scenes(model: nn.Module, works: Sequence[SceneWork], options: PredictOptions,
                   bar: Any, *, net: Any = None,
                   on_written: Callable[[int], None] | None = None) -> None:
    """Run the batches of each raster in turn; chunks are written on a background thread.

    One stream of batches through the tile engine (:func:`~seg_at_scale.tiling.engine.run_parts`):
    the next scene's first batch is read while the last one's runs. ``on_written(k)`` is
    called, on this thread and in order, once every batch of ``works[k]`` is on disk.
    ``net``: what runs the tiles, ``model`` or its :func:`~.compile_choice.checked_network`
    (by default made for these batches; an archive makes one for all its scenes).

    Raises:
        PartError: reading or writing ``works[part]`` failed (the works before it are
            written and told to ``on_written``).
    """
    device = next(model.parameters()).device
    if net is None:
        shapes: Counter[tuple[int, int, int]] = Counter()
        for w in works:
            shapes.update(forward_shapes(w.batches, height=w.grid.height, width=w.grid.width,
                                         fp=w.grid.footprint, tta=options.tta))
        net = checked_network(model, options.compile, shapes)
    parts = [Part(w.source, w.batches, w.grid.height, w.grid.width, w.grid.footprint,
                  _reads_into(w.stats)) for w in works]
    told = [0]  # the works told to on_written so far

    def written_through(k: int) -> None:
        while told[0] <= k:
            if on_written is not None:
                on_written(told[0])
            told[0] += 1

    with ThreadPoolExecutor(1) as writer:
        pending: tuple[int, Future] | None = None

        def wait_write() -> None:  # the batch in flight: bounded memory, errors surface
            nonlocal pending
            if pending is None:
                return
            k, fut = pending
            pending = None
            t1 = time.perf_counter()
            try:
                fut.result()
            except Exception as exc:
                raise PartError(k, exc) from exc
            finally:
                works[k].stats.write_s += time.perf_counter() - t1

        try:
            t0 = time.perf_counter()
            for res in run_parts(net, parts, device=device, autocast=options.autocast,
                                 channels_last=options.channels_last, tta=options.tta):
                work = works[res.part]
                outputs = _outputs(res, options.probabilities)
                work.stats.model_s += time.perf_counter() - t0
                wait_write()
                written_through(res.part - 1)
                pending = res.part, writer.submit(_write, work.store, res.batch, outputs)
                work.stats.tiles_computed += len(res.batch.tiles)
                bar.update(len(res.batch.tiles))
                t0 = time.perf_counter()
            wait_write()
        except PartError as exc:
            try:
                wait_write()  # the batch before the failure
            except PartError as before:
                if before.part < exc.part:  # an earlier work failed first
                    written_through(before.part - 1)
                    raise before from None
            written_through(exc.part - 1)
            raise
    written_through(len(works) - 1)


def _reads_into(stats: PredictionStats) -> Callable[[float, float], None]:
    def on_read(seconds: float, waited: float) -> None:
        stats.read_s += seconds
        stats.read_wait_s += waited

    return on_read


def _names(model: nn.Module, image: Path, fp: Footprint,
           class_names: Sequence[str] | None) -> list[str]:
    """The class names: given, or ``class_<k>`` for the model's classes."""
    if class_names:
        return list(class_names)
    k = int(getattr(model, "num_classes", 0))
    if not k:
        with RasterReader(image) as reader, torch.inference_mode():
            x = torch.zeros(1, reader.bands, fp.align * 4, fp.align * 4,
                            device=next(model.parameters()).device)
            k = int(model(x).shape[1])
    return [f"class_{i}" for i in range(k)]


def agreed(exc: SegAtScaleError) -> SegAtScaleError:
    """Mark ``exc`` as raised by every rank at the same point (:func:`raised_everywhere`)."""
    exc.all_ranks = True  # type: ignore[attr-defined]
    return exc


def raised_everywhere(exc: BaseException) -> bool:
    """Whether every rank raised ``exc`` at the same point (one process: always).

    The ranks can then go on together, to an archive's next scene; otherwise only this rank
    raised it, mid-work, and the others wait for it in a collective.
    """
    return bool(getattr(exc, "all_ranks", False)) or rank_world()[1] == 1


def scene_tile(options: PredictOptions, model: nn.Module, fp: Footprint,
               image: str | os.PathLike[str], world: int) -> PredictOptions:
    """``options`` with ``tile_size=auto`` made this scene's side (:func:`with_tile`).

    Rank 0 measures and every rank takes its side: a GPU's measured peak may differ between
    devices, and the ranks must share one grid.
    """
    if options.tile_size != "auto" or options.q is not None:
        return options
    with RasterReader(image, nodata=options.nodata) as head:
        bands, height, width = head.bands, head.height, head.width
    output_channels(model, bands, fp)  # runs on these bands, or refused before measuring
    return on_rank0(lambda: with_tile(options, model, fp, bands, height, width, world))


def on_rank0(fn: Any) -> Any:
    """``fn()`` on rank 0; its result on every rank, or its refusal raised on every rank."""
    if rank_world()[1] == 1:
        return fn()
    value, error = None, None
    if rank_world()[0] == 0:
        try:
            value = fn()
        except SegAtScaleError as exc:
            error = str(exc), type(exc)
    value, error = _share((value, error))
    if error is not None:
        raise agreed(error[1](error[0]))
    return value


def _share(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if rank_world()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _outputs(res: BatchOutput, probabilities: str | None) -> list[HostOutput]:
    """Per tile, its labels (and probabilities) on their way to the host (:class:`HostOutput`).

    On a GPU the copies are queued behind the batch's forward and nothing waits for them
    here: the next batch is queued while this one runs, and the writer's thread waits for
    the copies (one event per batch).
    """
    outs = [device_output(y, invalid, probabilities, res.probabilities)
            for y, invalid in zip(res.outputs, res.invalid, strict=True)]
    if res.outputs and res.outputs[0].is_cuda:
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(res.outputs[0].device))  # the copies' stream
        for o in outs:
            o.copied = copied
    return outs


@dataclass
class HostOutput:
    """One tile's core output as written: uint8 labels, probabilities, the no-data mask.

    ``labels`` / ``probs`` are host tensors; from a GPU, pinned and filled by copies that
    may still run until ``copied`` (a CUDA event) has passed. :meth:`arrays` waits for it.
    """

    labels: Tensor
    probs: Tensor | None
    invalid: np.ndarray | None
    copied: Any = None

    def arrays(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Labels ``[h, w]`` uint8 (255 on no data) and probabilities ``[K, h, w]``."""
        if self.copied is not None:
            self.copied.synchronize()
        labels = self.labels.numpy()
        probs = None if self.probs is None else self.probs.numpy()
        if self.invalid is not None:
            labels[self.invalid] = NODATA
            if probs is not None:
                probs[:, self.invalid] = 0
        return labels, probs


def device_output(y: Tensor, invalid: np.ndarray | None, probabilities: str | None,
                  is_probabilities: bool = False) -> HostOutput:
    """One tile's core output ``[K, h, w]`` (logits, or TTA's probabilities) for the host.

    Reduced where it is (argmax, uint8 or float16 probabilities), then copied to the host
    without waiting (:func:`_to_host`).
    """
    # argmax over classes reads K strided planes in NCHW; in NHWC the classes of a pixel
    # are adjacent, ~3x faster on CPU (ties still go to the first class)
    labels = y[None].contiguous(memory_format=torch.channels_last).argmax(1)[0]
    probs = None
    if probabilities is not None:
        p = y.float() if is_probabilities else torch.softmax(y.float(), dim=0)
        probs = _to_host(torch.round(p * 255).to(torch.uint8) if probabilities == "uint8"
                         else p.to(torch.float16))
    return HostOutput(_to_host(labels.to(torch.uint8)), probs, invalid)


def _to_host(t: Tensor) -> Tensor:
    """``t`` on the host: itself there; from a GPU, a pinned copy queued on its stream."""
    if t.device.type == "cpu":
        return t
    if t.device.type != "cuda":
        return t.cpu()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def tile_output(y: Tensor, invalid: np.ndarray | None, probabilities: str | None,
                is_probabilities: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """One tile's core output ``[K, h, w]`` as written (:func:`device_output`, waited for)."""
    out = device_output(y, invalid, probabilities, is_probabilities)
    if y.is_cuda:
        out.copied = torch.cuda.Event()
        out.copied.record(torch.cuda.current_stream(y.device))
    return out.arrays()


def _write(store: PredictionStore, batch: Batch, outputs: list[HostOutput]) -> None:
    """The writer's thread: each tile's chunks, once its copies from the device are done."""
    for tile, out in zip(batch.tiles, outputs, strict=True):
        labels, probs = out.arrays()
        if not store.done(tile):  # a recomputed batch may hold tiles already on disk
            store.write(tile, labels, probs)
