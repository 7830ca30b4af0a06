"""The pixel threads: one pool per process, bands cut in pieces of rows."""

from __future__ import annotations

import numpy as np
import pytest

import seg_at_scale.io.threads as threads
from seg_at_scale.io.threads import by_rows, pixel_threads, thread_count


def test_pieces_cover_every_row_once_in_multiples_and_a_pool_thread_runs_its_own(
        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(threads, "PIECE_PIXELS", 10)
    pieces = by_rows(lambda r0, r1: (r0, r1), 101, 7, multiple=4)
    assert 2 <= len(pieces) <= 4 * thread_count()
    assert pieces[0][0] == 0 and pieces[-1][1] == 101
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert all((r1 - r0) % 4 == 0 for r0, r1 in pieces[:-1])
    # a job already on the pool cuts nothing (waiting on its own pool could deadlock it)
    nested = pixel_threads().submit(by_rows, lambda r0, r1: (r0, r1), 101, 7)
    assert nested.result(timeout=10) == [(0, 101)]
    monkeypatch.setattr(threads, "PIECE_PIXELS", 10**9)  # a small band: one piece here
    assert by_rows(lambda r0, r1: (r0, r1), 101, 7) == [(0, 101)]


def test_the_label_histogram_in_pieces_counts_every_pixel_once(
        monkeypatch: pytest.MonkeyPatch):
    from seg_at_scale.prediction.finalize import _label_counts

    rng = np.random.default_rng(1)
    band = rng.integers(0, 256, (257, 131)).astype(np.uint8)
    monkeypatch.setattr(threads, "PIECE_PIXELS", 500)
    np.testing.assert_array_equal(_label_counts(band), np.bincount(band.ravel(), minlength=256))
