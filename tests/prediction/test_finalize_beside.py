"""The COG is written beside the tiles (``raster.finalize_beside``), by rank 0 with any number
of ranks: each row band of the store is read once every rank's chunks of it are on disk.
The same files as the finalisation after the last tile (forced here for the reference),
written while the model still runs; a prediction that stops midway, or whose other rank
fails, leaves no output and no temporary file, and its rerun resumes to the same bytes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from helpers.prediction import NORM, make_image, make_model

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.errors import InputError
from seg_at_scale.prediction import predict_raster
from seg_at_scale.prediction import raster as raster_module
from seg_at_scale.prediction.finalize import RowsOnDisk
from seg_at_scale.prediction.options import PredictOptions

NORMALIZER = Normalizer(NORM["scale"], tuple(NORM["mean"]), tuple(NORM["std"]))


def _options(**extra):
    return PredictOptions(tile_size=96, progress=False, batch_size=2, **extra)


def _beside(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(raster_module, "finalize_beside", lambda *a: on)


def _cog_files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix == ".tif"}


@pytest.mark.parametrize("probabilities", [None, "float16"])
def test_the_cog_written_beside_the_tiles_is_the_one_written_after_them(
        tmp_path, monkeypatch, one_torch_thread, probabilities):
    model = make_model(levels=3, width=4)
    image = make_image(tmp_path / "a.tif", 301, 417)
    after, beside = tmp_path / "after", tmp_path / "beside"
    after.mkdir(), beside.mkdir()
    _beside(monkeypatch, False)
    predict_raster(model, image, after / "out.tif", _options(probabilities=probabilities),
                   normalizer=NORMALIZER)

    # each forward takes 20 ms more; each row band read says how many forwards had run
    forwards, rows = [0], []

    def slow(*_):
        time.sleep(0.02)
        forwards[0] += 1

    waited = RowsOnDisk.__call__

    def logged(self, row):
        waited(self, row)
        rows.append((row, forwards[0]))

    monkeypatch.setattr(RowsOnDisk, "__call__", logged)
    handle = model.register_forward_hook(slow)
    _beside(monkeypatch, True)
    stats = predict_raster(model, image, beside / "out.tif",
                           _options(probabilities=probabilities), normalizer=NORMALIZER)
    handle.remove()
    assert stats.tiles_computed == stats.tiles > 12
    assert _cog_files(beside) == _cog_files(after)  # the labels' COG (and probabilities')
    assert len(_cog_files(after)) == (2 if probabilities else 1)
    assert sorted(p.name for p in beside.iterdir()) == sorted(p.name for p in after.iterdir())
    labels_rows = rows[-len({r for r, _ in rows}):]
    assert [r for r, _ in labels_rows] == list(range(len(labels_rows)))
    # the first row was written out while the model was still computing later rows
    assert rows[0][1] < forwards[0], (rows, forwards)


def test_a_prediction_stopped_midway_leaves_nothing_final_and_resumes(tmp_path, monkeypatch,
                                                                      one_torch_thread):
    model = make_model(levels=3, width=4)
    image = make_image(tmp_path / "a.tif", 301, 417)
    ref, out = tmp_path / "ref", tmp_path / "out"
    ref.mkdir(), out.mkdir()
    _beside(monkeypatch, False)
    predict_raster(model, image, ref / "out.tif", _options(), normalizer=NORMALIZER)
    _beside(monkeypatch, True)
    calls = [0]

    def stop_at_the_fifth(*_):
        calls[0] += 1
        if calls[0] == 5:
            raise KeyboardInterrupt  # as Ctrl-C, or a SIGTERM turned into an exception

    handle = model.register_forward_hook(stop_at_the_fifth)
    before = set(threading.enumerate())
    with pytest.raises(KeyboardInterrupt):
        predict_raster(model, image, out / "out.tif", _options(), normalizer=NORMALIZER)
    handle.remove()
    assert set(threading.enumerate()) <= before  # the finalising thread ended with it
    left = sorted(p.name for p in out.iterdir())
    assert not (out / "out.tif").exists()
    assert [n for n in left if n.endswith(".tmp") or "partial" in n] == [], left
    stats = predict_raster(model, image, out / "out.tif", _options(), normalizer=NORMALIZER)
    assert 0 < stats.tiles_resumed < stats.tiles
    assert _cog_files(out) == _cog_files(ref)


class _Store:
    """Stands for a PredictionStore: chunks of 10 x 10 over 25 x 30, three rows of three."""

    chunk = (10, 10)

    class labels:  # noqa: N801 - stands for a zarr array
        shape = (25, 30)

    def __init__(self, path):
        self.path = path
        self.on_disk: set[tuple[int, int]] = set()

    def done(self, tile):
        return tile.index in self.on_disk


def test_rows_on_disk_waits_for_a_row_and_stops_when_aborted(tmp_path, monkeypatch):
    from seg_at_scale.prediction import finalize as finalize_module

    store = _Store(tmp_path)
    ready = RowsOnDisk(store, poll_s=0.005)
    store.on_disk |= {(0, 0), (0, 1), (0, 2), (1, 0)}
    ready(0)  # on disk: returns at once
    waiting = threading.Thread(target=ready, args=(1,))
    waiting.start()
    time.sleep(0.02)
    assert waiting.is_alive()  # (1, 1) and (1, 2) are missing
    store.on_disk |= {(1, 1), (1, 2)}
    waiting.join(5)
    assert not waiting.is_alive()
    ready.abort()
    with pytest.raises(RowsOnDisk.Aborted, match="row 2"):
        ready(2)
    # every tile written, a chunk still missing: the error, not a wait without end
    done = RowsOnDisk(store, poll_s=0.005)
    done.all_written()
    done(1)
    with pytest.raises(InputError, match=r"misses 3 tiles .*first: \(2, 0\).*rerun the same"):
        done(2)
    assert [t.index for t in finalize_module._row_tiles(store, 2)] == [(2, 0), (2, 1), (2, 2)]
    assert [t.core.height for t in finalize_module._row_tiles(store, 2)] == [5, 5, 5]


def test_rows_on_disk_looks_at_once_on_news(tmp_path):
    """A tile this process wrote, or every tile written, ends a wait at once (one process
    waits on its own writes, with a long poll as a fallback only)."""
    store = _Store(tmp_path)
    for news, row in (("wrote", 1), ("all_written", 2)):
        slow = RowsOnDisk(store, poll_s=60.0)
        waiting = threading.Thread(target=slow, args=(row,))
        waiting.start()
        time.sleep(0.05)
        store.on_disk |= {(row, 0), (row, 1), (row, 2)}
        getattr(slow, news)()  # no 60 s wait for the next look
        waiting.join(5)
        assert not waiting.is_alive() and slow.looks == 2, news


def test_the_store_tells_its_watchers_after_each_tile_is_on_disk(tmp_path):
    import numpy as np

    from seg_at_scale.prediction.store import PredictionStore
    from seg_at_scale.tiling import Footprint, make_grid

    grid = make_grid(70, 45, Footprint(0, 1, "same"), tile_size=32, uniform=True)
    store = PredictionStore.open(tmp_path / "s.zarr", grid, fingerprint={"test": 1},
                                 num_classes=3, probabilities="uint8", attrs={},
                                 resume=False)
    seen: list[int] = []
    store.watch(lambda: seen.append(sum(store.done(t) for t in grid.tiles)))
    for tile in grid.tiles:
        h, w = tile.core.height, tile.core.width
        store.write(tile, np.ones((h, w), np.uint8), np.zeros((3, h, w), np.uint8))
    assert seen == list(range(1, len(grid.tiles) + 1)) and len(seen) == 6


def test_a_cog_that_fails_beside_the_tiles_stops_them_and_the_rerun_completes(
        tmp_path, monkeypatch, one_torch_thread):
    """A full disk met by the COG (its largest file) ends the run at the next batch, not
    after the last tile: the tiles on disk stay, and the rerun computes only the rest."""
    import errno

    from seg_at_scale.prediction import finalize as finalize_module

    model = make_model(levels=3, width=4)
    image = make_image(tmp_path / "a.tif", 301, 417)
    ref, out = tmp_path / "ref", tmp_path / "out"
    ref.mkdir(), out.mkdir()
    _beside(monkeypatch, False)
    whole = predict_raster(model, image, ref / "out.tif", _options(), normalizer=NORMALIZER)
    _beside(monkeypatch, True)
    real = finalize_module.write_cog

    def full_after_one_band(path, shape, dtype, bands, **kw):
        next(iter(bands))
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(finalize_module, "write_cog", full_after_one_band)
    handle = model.register_forward_hook(lambda *_: time.sleep(0.05))
    with pytest.raises(OSError, match="No space left"):
        predict_raster(model, image, out / "out.tif", _options(), normalizer=NORMALIZER)
    handle.remove()
    monkeypatch.setattr(finalize_module, "write_cog", real)
    assert not (out / "out.tif").exists()
    stats = predict_raster(model, image, out / "out.tif", _options(), normalizer=NORMALIZER)
    assert stats.tiles_resumed > 0
    assert stats.tiles_computed > whole.tiles // 2  # the first run stopped early on
    assert _cog_files(out) == _cog_files(ref)


def _two_ranks(rank: int, world: int, image: str, output: str, report: str) -> None:
    """One rank of a two-rank prediction: rank 1 lags (50 ms a forward) and fails at its
    fifth forward; rank 0 records how many tiles of the run were on disk when it took each
    row band for the COG. Its end goes into ``report.<rank>``."""
    import json

    from seg_at_scale.parallel.launch import close_group

    model = make_model(levels=3, width=4)
    forwards, rows = [0], []

    def lag(*_):
        forwards[0] += 1
        time.sleep(0.05)
        if forwards[0] == 5:
            raise RuntimeError("rank 1 failed")

    if rank == 1:
        model.register_forward_hook(lag)
    waited = RowsOnDisk.__call__

    def logged(self, row):
        waited(self, row)
        rows.append(sum(map(self.store.done, _tiles_of(self.store))))

    RowsOnDisk.__call__ = logged  # a process of its own: nothing to restore
    try:
        predict_raster(model, image, output, _options(), normalizer=NORMALIZER)
        end = {"error": None}
    except Exception as exc:  # a failed rank leaves the group, as its process's end would
        close_group()
        end = {"error": f"{type(exc).__name__}: {exc}"}
    Path(f"{report}.{rank}").write_text(json.dumps({**end, "rows": rows}))


def _tiles_of(store):
    from seg_at_scale.prediction.finalize import _all_tiles

    return list(_all_tiles(store))


def test_two_ranks_write_the_cog_beside_their_tiles_and_a_failed_rank_stops_it(tmp_path,
                                                                               monkeypatch):
    """With several ranks rank 0 writes each row band once every rank's chunks of it are on
    disk, while the ranks still compute. A rank that fails midway stops rank 0's COG with
    it (nothing final, no temporary file), and the rerun resumes to the one-process bytes."""
    import json

    from seg_at_scale.parallel.launch import spawn

    image = make_image(tmp_path / "a.tif", 301, 417)
    ref, out = tmp_path / "ref", tmp_path / "out"
    ref.mkdir(), out.mkdir()
    _beside(monkeypatch, False)
    predict_raster(make_model(levels=3, width=4), image, ref / "out.tif", _options(),
                   normalizer=NORMALIZER)
    monkeypatch.undo()
    report = str(tmp_path / "report")
    spawn(_two_ranks, 2, str(image), str(out / "out.tif"), report, threads=1)
    ends = [json.loads(Path(f"{report}.{r}").read_text()) for r in (0, 1)]
    assert ends[0]["error"] and ends[1]["error"] == "RuntimeError: rank 1 failed", ends
    assert not (out / "out.tif").exists()
    left = sorted(p.name for p in out.iterdir())
    assert [n for n in left if n.endswith(".tmp") or "partial" in n] == [], left
    taken = ends[0]["rows"]  # tiles on disk as rank 0 took each row band
    stats = predict_raster(make_model(levels=3, width=4), image, out / "out.tif", _options(),
                           normalizer=NORMALIZER)
    assert taken and taken[0] < stats.tiles, taken  # a row band taken while ranks computed
    assert 0 < stats.tiles_resumed < stats.tiles
    assert _cog_files(out) == _cog_files(ref)
