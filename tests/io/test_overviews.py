"""Mode overviews of class labels: the table of 2 x 2 modes equals counting each class, and
every overview level of a written label COG is the mode of the level above it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import rasterio

from seg_at_scale.io.cog import class_colors, write_cog
from seg_at_scale.io.overviews import NODATA, mode2x2, mode2x2_counted, overview_shapes


def reference_mode(band: np.ndarray, num_classes: int) -> np.ndarray:
    """Each 2 x 2 block's most frequent class below ``num_classes`` (the lowest on a tie),
    no-data where a block holds none; odd sides padded with no-data."""
    h, w = band.shape
    padded = np.full((h + h % 2, w + w % 2), NODATA, np.uint8)
    padded[:h, :w] = band
    quads = np.stack([padded[r::2, c::2] for r in (0, 1) for c in (0, 1)])
    counts = np.stack([(quads == k).sum(0) for k in range(num_classes)])
    best = counts.argmax(0).astype(np.uint8)  # argmax: the first (lowest) class on a tie
    best[counts.max(0) == 0] = NODATA
    return best


@pytest.mark.parametrize("num_classes", [1, 2, 5, 14, 15, 16, 40])
def test_the_mode_table_equals_counting_each_class(num_classes: int):
    rng = np.random.default_rng(num_classes)
    for shape in ((2, 2), (6, 7), (10, 33), (64, 129)):
        band = rng.integers(0, num_classes, shape).astype(np.uint8)
        band[rng.random(shape) < 0.2] = NODATA
        band[rng.random(shape) < 0.05] = num_classes + 3  # not a class: ignored like no-data
        band[rng.random(shape) < 0.02] = 200
        got = mode2x2(band[: shape[0] - shape[0] % 2], num_classes)
        np.testing.assert_array_equal(got, reference_mode(band[: shape[0] - shape[0] % 2],
                                                          num_classes))
        even = np.pad(band, ((0, 0), (0, shape[1] % 2)), constant_values=NODATA)
        np.testing.assert_array_equal(mode2x2_counted(even[: shape[0] - shape[0] % 2],
                                                      num_classes), got)


@pytest.mark.parametrize("pieces", [False, True], ids=["one_piece", "row_pieces"])
def test_a_label_cog_s_overviews_are_the_modes_of_the_level_above(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pieces: bool):
    """301 x 257 labels (odd sides), 5 classes in 3 x 3 patches with 30 % noise, no-data
    in a corner, written in row bands of 37 rows with 64 px blocks: three overview levels,
    each band in one piece or in row pieces on the pixel threads."""
    if pieces:
        monkeypatch.setattr("seg_at_scale.io.threads.PIECE_PIXELS", 500)
    rng = np.random.default_rng(7)
    labels = np.repeat(np.repeat(rng.integers(0, 5, (101, 86)), 3, 0), 3, 1)[:301, :257]
    labels = labels.astype(np.uint8)
    noise = rng.random(labels.shape) < 0.3
    labels[noise] = rng.integers(0, 5, int(noise.sum()))
    labels[:40, :50] = NODATA
    bands = (labels[None, r : r + 37] for r in range(0, 301, 37))
    path = write_cog(tmp_path / "labels.tif", (1, 301, 257), "uint8", bands, nodata=NODATA,
                     colormap=class_colors(5), resampling="mode", blocksize=64)
    shapes = overview_shapes(301, 257, 64)
    assert shapes == [(151, 129), (76, 65), (38, 33)]
    above = labels
    for level, shape in enumerate(shapes):
        with rasterio.open(path, overview_level=level) as ds:
            got = ds.read(1)
        assert got.shape == shape
        np.testing.assert_array_equal(got, reference_mode(above, 5), err_msg=f"level {level}")
        above = got
    with rasterio.open(path) as ds:
        np.testing.assert_array_equal(ds.read(1), labels)


@pytest.mark.parametrize("num_classes", [5, 40])
def test_a_band_in_row_pieces_on_the_pixel_threads_has_the_modes_of_one_piece(
        monkeypatch: pytest.MonkeyPatch, num_classes: int):
    """Past ``PIECE_PIXELS`` the 2 x 2 modes are computed in pieces of rows on the pixel
    threads (an even number of rows each, the last one shorter), for the table and for
    counting: the same labels as the reference, odd widths and no-data included."""
    import threading

    import seg_at_scale.io.threads as threads

    rng = np.random.default_rng(7)
    band = rng.integers(0, num_classes, (2 * 71, 203)).astype(np.uint8)
    band[rng.random(band.shape) < 0.1] = NODATA
    want = reference_mode(band, num_classes)
    seen: list[tuple[int, int, str]] = []
    real = threads.by_rows

    def watched(fn, rows, width, *, multiple=1):
        def piece(r0, r1):
            seen.append((r0, r1, threading.current_thread().name))
            return fn(r0, r1)
        return real(piece, rows, width, multiple=multiple)

    monkeypatch.setattr(threads, "PIECE_PIXELS", 1000)
    monkeypatch.setattr("seg_at_scale.io.overviews.by_rows", watched)
    np.testing.assert_array_equal(mode2x2(band, num_classes), want)
    pieces = sorted(seen)
    assert len(pieces) > 2 and pieces[0][0] == 0 and pieces[-1][1] == band.shape[0]
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))  # every row, once
    assert all((r1 - r0) % 2 == 0 for r0, r1, _ in pieces)
    assert all(name.startswith(threads.PREFIX) for *_, name in pieces)
