"""Raster I/O: windowed reads equal slices, streaming writes round-trip, errors are clear."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import tifffile
from helpers.io import CountingFile, make_array
from PIL import Image

from seg_at_scale.errors import InputError, OutputExistsError
from seg_at_scale.io import (
    RasterReader,
    example_geotags,
    read_overview,
    read_raster,
    write_preview_png,
    write_raster,
    write_raster_bands,
)
from seg_at_scale.io import preview as preview_mod
from seg_at_scale.io import raster as raster_mod
from seg_at_scale.io.preview import default_palette
from seg_at_scale.tiling.geometry import Window

H, W = 301, 257  # not multiples of the tile / strip sizes
TILE = (64, 48)
WINDOWS = [
    Window(0, 0, H, W),  # everything
    Window(0, 0, 1, 1),
    Window(63, 47, 2, 2),  # four tiles meet
    Window(17, 5, 150, 100),
    Window(250, 200, 51, 57),  # bottom-right partial tiles
    Window(300, 0, 1, W),  # last row
]


def _windows_match(path: Path, array: np.ndarray) -> None:
    with RasterReader(path) as reader:
        assert reader.shape == array.shape and reader.dtype == array.dtype
        for win in WINDOWS:
            np.testing.assert_array_equal(reader.read(win), array[(slice(None), *win.slices())])


@pytest.mark.parametrize("tile", [TILE, None], ids=["tiled", "striped"])
@pytest.mark.parametrize("compression", [None, "zlib", "lzw"])
@pytest.mark.parametrize("dtype", ["uint8", "uint16", "float32"])
def test_windows_equal_slices_formats(tmp_path: Path, tile: tuple[int, int] | None,
                                      compression: str | None, dtype: str) -> None:
    array = make_array((3, H, W), dtype)
    path = write_raster(tmp_path / "a.tif", array, tile=tile, compression=compression)
    _windows_match(path, array)


@pytest.mark.parametrize("tile", [TILE, None], ids=["tiled", "striped"])
@pytest.mark.parametrize("bands", [1, 3, 4])
@pytest.mark.parametrize("planar", [False, True], ids=["interleaved", "planar"])
@pytest.mark.parametrize("bigtiff", [False, True], ids=["tiff", "bigtiff"])
def test_windows_equal_slices_layouts(tmp_path: Path, tile: tuple[int, int] | None, bands: int,
                                      planar: bool, bigtiff: bool) -> None:
    array = make_array((bands, H, W), "uint16", seed=bands)
    path = write_raster(tmp_path / "a.tif", array, tile=tile, planar=planar, bigtiff=bigtiff)
    with tifffile.TiffFile(path) as tif:
        page = tif.pages.first
        assert tif.is_bigtiff == bigtiff and page.is_tiled == (tile is not None)
        assert page.samplesperpixel == bands
        assert bands == 1 or (int(page.planarconfig) == 2) == planar
    _windows_match(path, array)


def test_single_band_is_plain_2d(tmp_path: Path) -> None:
    mask = make_array((H, W), "uint8")
    path = write_raster(tmp_path / "m.tif", mask)
    assert tifffile.imread(path).shape == (H, W)
    np.testing.assert_array_equal(read_raster(path), mask[None])


FILL_WINDOWS = [
    Window(-5, -7, 20, 30),
    Window(290, 250, 40, 30),
    Window(-700, -600, 1500, 1400),  # further out than the image is long: reflect repeats
    Window(400, -300, 10, 20),  # entirely outside
]


@pytest.mark.parametrize("fill", ["reflect", "constant"])
@pytest.mark.parametrize("window", FILL_WINDOWS, ids=str)
def test_fill_equals_numpy_pad(tmp_path: Path, fill: str, window: Window) -> None:
    array = make_array((2, H, W), "float32")
    path = write_raster(tmp_path / "a.tif", array, tile=TILE)
    p = 800
    padded = np.pad(array, ((0, 0), (p, p), (p, p)), mode=fill)  # type: ignore[call-overload]
    expected = padded[:, window.row + p:window.row_end + p, window.col + p:window.col_end + p]
    with RasterReader(path) as reader:
        np.testing.assert_array_equal(reader.read(window, fill=fill), expected)  # type: ignore[arg-type]


def test_reflect_single_row_image(tmp_path: Path) -> None:
    array = make_array((1, 1, 37), "uint8")
    path = write_raster(tmp_path / "a.tif", array, tile=None)
    expected = np.pad(array, ((0, 0), (5, 5), (3, 3)), mode="reflect")
    with RasterReader(path) as reader:
        np.testing.assert_array_equal(reader.read(Window(-5, -3, 11, 43), fill="reflect"),
                                      expected)


def test_out_of_bounds_without_fill_names_file_window_size(tmp_path: Path) -> None:
    path = write_raster(tmp_path / "scene.tif", make_array((1, H, W), "uint8"))
    with RasterReader(path) as reader, pytest.raises(InputError) as err:
        reader.read(Window(-1, 0, 10, 10))
    message = str(err.value)
    assert "scene.tif" in message and "row=-1" in message and f"{H}x{W}" in message


def test_reads_only_the_tiles_a_window_touches(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    array = make_array((4, 2000, 1800), "uint8")
    path = write_raster(tmp_path / "big.tif", array, tile=(128, 128), compression="zlib")
    window = Window(1000, 900, 100, 100)
    with tifffile.TiffFile(path) as tif:
        page = tif.pages.first
        header = min(page.dataoffsets)  # header + IFD + tag values precede the tiles
        n_cols = -(-1800 // 128)
        touched = [i * n_cols + j for i in (7, 8) for j in (7,)]  # rows 1000-1099, cols 900-999
        touched_bytes = sum(page.databytecounts[k] for k in touched)
    monkeypatch.setattr(raster_mod, "_open_binary", lambda p: CountingFile(p, "rb"))
    CountingFile.count = 0
    with RasterReader(path) as reader:
        patch = reader.read(window)
    np.testing.assert_array_equal(patch, array[(slice(None), *window.slices())])
    assert CountingFile.count < 3 * touched_bytes + header
    assert CountingFile.count < path.stat().st_size / 50


@pytest.mark.parametrize("tile", [TILE, None], ids=["tiled", "striped"])
def test_streaming_writer_uneven_bands(tmp_path: Path, tile: tuple[int, int] | None) -> None:
    array = make_array((3, H, W), "uint16")
    edges = np.cumsum([0, 37, 100, 1, 163])
    bands = (array[:, a:b] for a, b in zip(edges[:-1], edges[1:], strict=True))
    path = write_raster_bands(tmp_path / "s.tif", array.shape, array.dtype, bands, tile=tile)
    np.testing.assert_array_equal(read_raster(path), array)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.tif"]


def test_streaming_writer_failure_keeps_existing_file(tmp_path: Path) -> None:
    path = write_raster(tmp_path / "s.tif", make_array((1, H, W), "uint8"))
    before = path.read_bytes()

    def bands():  # type: ignore[no-untyped-def]
        yield np.zeros((1, 100, W), np.uint8)
        raise RuntimeError("model crashed")

    with pytest.raises(RuntimeError, match="model crashed"):
        write_raster_bands(path, (1, H, W), np.uint8, bands(), overwrite=True)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.tif"]


def test_writer_refuses_existing_output(tmp_path: Path) -> None:
    path = write_raster(tmp_path / "s.tif", make_array((1, 20, 30), "uint8"))
    with pytest.raises(OutputExistsError) as err:
        write_raster(path, make_array((1, 20, 30), "uint8"))
    assert str(err.value) == (f"output '{path}' already exists; pass overwrite=true to replace "
                              "it (or choose another path)")


@pytest.mark.parametrize("shapes, fragment", [
    ([(3, 100, W - 1)], "a band has shape (3, 100, 256)"),
    ([(2, 100, W)], "a band has shape (2, 100, 257)"),
    ([(3, 100, W), (3, 100, W)], f"200 rows but the image has {H}"),
    ([(3, 200, W), (3, 200, W)], f"more than the {H} rows"),
])
def test_streaming_writer_rejects_bad_bands(tmp_path: Path, shapes: list[tuple[int, ...]],
                                            fragment: str) -> None:
    bands = (np.zeros(s, np.uint8) for s in shapes)
    with pytest.raises(InputError) as err:
        write_raster_bands(tmp_path / "s.tif", (3, H, W), np.uint8, bands)
    assert fragment in str(err.value) and "s.tif" in str(err.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype, nodata", [("uint16", 65535.0), ("float32", -9999.5),
                                           ("float32", float("nan"))])
def test_geotags_and_nodata_round_trip(tmp_path: Path, dtype: str, nodata: float) -> None:
    tags = example_geotags(origin=(612345.5, 5012345.0), pixel_size=0.5, epsg=32633)
    path = write_raster(tmp_path / "g.tif", make_array((2, H, W), dtype), geotags=tags,
                        nodata=nodata)
    with RasterReader(path) as reader:
        assert reader.geotags == tags and not reader.geotags.is_empty
        np.testing.assert_equal(reader.nodata, nodata)
    with tifffile.TiffFile(path) as tif:
        geo = tif.pages.first.geotiff_tags
        assert int(geo["ProjectedCSTypeGeoKey"]) == 32633
        assert geo["ModelPixelScale"] == [0.5, 0.5, 0.0]
    with RasterReader(path, nodata=7.0) as reader:
        assert reader.nodata == 7.0  # the argument wins over the tag


def test_plain_tiff_has_no_geotags_or_nodata(tmp_path: Path) -> None:
    path = write_raster(tmp_path / "p.tif", make_array((1, 20, 30), "uint8"))
    with RasterReader(path) as reader:
        assert reader.geotags.is_empty and reader.nodata is None and not reader.is_float


def test_nodata_outside_dtype_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="nodata=-1 cannot be stored in uint8"):
        write_raster(tmp_path / "n.tif", make_array((1, 20, 30), "uint8"), nodata=-1)
    assert list(tmp_path.iterdir()) == []


def test_truncated_file_message(tmp_path: Path) -> None:
    path = write_raster(tmp_path / "cut.tif", make_array((3, H, W), "uint8"))
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size - 100)
    with pytest.raises(InputError) as err:
        RasterReader(path)
    assert str(err.value) == (f"'{path}' is truncated: its data ends at byte {size} but the "
                              f"file has {size - 100} bytes. Re-copy or re-generate it.")


@pytest.mark.parametrize("content", [b"II*\x00 and then not a tiff at all", b"", None],
                         ids=["broken", "empty", "missing"])
def test_unreadable_file_message(tmp_path: Path, content: bytes | None) -> None:
    """(A file that does not start like a TIFF is GDAL's to read: test_gdal_rasters.)"""
    path = tmp_path / "notatiff.tif"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InputError) as err:
        RasterReader(path)
    message = str(err.value)
    assert message.startswith(f"cannot read '{path}' as TIFF: ")
    assert message.endswith("Check the path, or re-create / re-copy the file.")


def test_corrupt_tile_is_reported_with_file_and_window(tmp_path: Path) -> None:
    path = write_raster(tmp_path / "bad.tif", make_array((1, H, W), "uint8"), tile=TILE)
    with tifffile.TiffFile(path) as tif:
        offset = tif.pages.first.dataoffsets[0]
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(b"\xff" * 64)
    with RasterReader(path) as reader:
        np.testing.assert_array_equal(reader.read(Window(200, 200, 5, 5)).shape, (1, 5, 5))
        with pytest.raises(InputError, match=r"cannot decode rows 0:5, cols 0:5 of '.*bad.tif'"):
            reader.read(Window(0, 0, 5, 5))


def test_pickled_reader_reads_the_same(tmp_path: Path) -> None:
    path = write_raster(tmp_path / "a.tif", make_array((3, H, W), "uint8"), nodata=3)
    window = Window(-10, 40, 100, 120)
    with RasterReader(path) as reader:
        expected = reader.read(window, fill="reflect")
        payload = pickle.dumps(reader)
    assert len(payload) < 500  # path + nodata only, no file handle or data
    clone = pickle.loads(payload)
    np.testing.assert_array_equal(clone.read(window, fill="reflect"), expected)
    assert clone.nodata == 3 and clone.shape == (3, H, W)
    clone.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_reader_reopens_after_fork(tmp_path: Path) -> None:
    array = make_array((2, H, W), "uint8")
    path = write_raster(tmp_path / "a.tif", array)
    window = Window(100, 30, 64, 64)
    with RasterReader(path) as reader:
        reader.read(window)  # the parent's handle is open before forking
        pid = os.fork()
        if pid == 0:  # child: must not use the parent's file offset
            ok = reader._fh is not None and np.array_equal(
                reader.read(window), array[(slice(None), *window.slices())])
            os._exit(0 if ok and reader._pid == os.getpid() else 1)
        _, status = os.waitpid(pid, 0)
        np.testing.assert_array_equal(reader.read(window), array[(slice(None), *window.slices())])
    assert os.waitstatus_to_exitcode(status) == 0


def test_read_overview_equals_strided_array(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    array = make_array((3, H, W), "uint16")
    path = write_raster(tmp_path / "a.tif", array, tile=TILE)
    monkeypatch.setattr(preview_mod, "_BAND_BYTES", 3 * W * 2 * 9)  # several row bands
    with RasterReader(path) as reader:
        overview = read_overview(reader, max_side=100)
    assert overview.shape == (3, 76, 65)  # stride ceil(301 / 100) = 4
    np.testing.assert_array_equal(overview, array[:, ::4, ::4])


def test_preview_blends_palette_over_image(tmp_path: Path) -> None:
    image = make_array((4, 37, 41), "uint16")
    mask = np.tile(np.arange(41) % 5, (37, 1)).astype(np.uint8)
    mask[mask == 4] = 255  # ignored: not drawn
    alpha, palette = 0.4, default_palette(4)
    base = np.asarray(Image.open(write_preview_png(tmp_path / "b.png", image, None, 4)))
    path = write_preview_png(tmp_path / "m.png", image, mask, 4, alpha=alpha)
    blended = np.asarray(Image.open(path)).astype(np.float64)
    assert blended.shape == (37, 41, 3)
    for k in range(4):
        expected = np.round((1 - alpha) * base[mask == k] + alpha * np.asarray(palette[k]))
        np.testing.assert_array_equal(blended[mask == k], expected)
    np.testing.assert_array_equal(blended[mask == 255], base[mask == 255])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.png", "m.png"]


def test_preview_gray_and_bad_mask(tmp_path: Path) -> None:
    image = make_array((1, 20, 30), "float32")
    rgb = np.asarray(Image.open(write_preview_png(tmp_path / "g.png", image, None, 2)))
    assert (rgb[..., 0] == rgb[..., 1]).all() and rgb.min() == 0 and rgb.max() == 255
    with pytest.raises(InputError, match="mask holds class id 7 but num_classes=2"):
        write_preview_png(tmp_path / "x.png", image, np.full((20, 30), 7), 2)


def test_writer_rejects_bad_tile_size(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"tile=\(100, 64\) is not a TIFF tile size"):
        write_raster(tmp_path / "t.tif", make_array((1, 20, 30), "uint8"), tile=(100, 64))


def test_a_dead_writers_temporaries_are_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    import subprocess
    import sys

    from seg_at_scale.io.writer import remove_stale_temporaries, temporary_path

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(dead.stdout)  # a process that has ended
    out = tmp_path / "mask.tif"
    stale = [f".mask.tif.plain.{pid}-0a1b2c3d.tmp", f".mask.tif.cog.{pid}-9f8e7d6c.tmp",
             f".mask.tif.ov1.{pid}.tmp", f".mask.tif.partial.{pid}-00aa11bb.gpkg"]
    kept = [temporary_path(out, "plain").name,  # this live process's
            ".mask.output.lock", ".mask.tif.notes.txt", f".other.tif.plain.{pid}-0a1b2c3d.tmp",
            "mask.tif.plain.1-0a1b2c3d.tmp"]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / ".mask.tif.zarr").mkdir()  # the working store: a folder, never removed
    assert remove_stale_temporaries(out) == len(stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, ".mask.tif.zarr"])


def test_an_archives_outputs_find_their_temporaries_in_one_listing(tmp_path: Path,
                                                                   monkeypatch) -> None:
    """Within ``listed_once`` the folder is read once for all outputs (not per output), and
    each output's dead writers' temporaries are removed by the same rule; after it, a
    temporary left since is found by listing the folder again."""
    import subprocess
    import sys

    from seg_at_scale.io.writer import listed_once, remove_stale_temporaries, temporary_path

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(dead.stdout)
    outs = [tmp_path / f"s{k}.tif" for k in range(40)]
    live = []
    for k, out in enumerate(outs):
        out.write_bytes(b"done")
        for name in (f".{out.name}.cog.{pid}-0a1b2c{k:02d}.tmp", f".{out.name}.ov1.{pid}.tmp"):
            (tmp_path / name).write_bytes(b"x")
        live.append(temporary_path(out, "plain"))
        live[-1].write_bytes(b"x")
    scans: list[str] = []
    real_scandir = os.scandir

    def scandir(path):
        scans.append(str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(Path, "glob", lambda *a: pytest.fail("a folder listed per output"))
    with listed_once([tmp_path, tmp_path / ".", tmp_path / "missing"]):
        assert sum(remove_stale_temporaries(out) for out in outs) == 2 * len(outs)
    assert scans == [str(tmp_path), str(tmp_path / "missing")]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [o.name for o in outs] + [p.name for p in live])
    monkeypatch.undo()
    (tmp_path / f".s3.tif.cog.{pid}-00000000.tmp").write_bytes(b"x")
    assert remove_stale_temporaries(outs[3]) == 1
