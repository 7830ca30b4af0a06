"""Reads that fit the file: memory-mapped strips, a warning for huge compressed segments,
GDAL's internal mask (files written by GDAL itself, through rasterio)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from helpers.io import CountingFile, make_array, write_with_gdal_mask

import seg_at_scale.io.raster as raster_mod
from seg_at_scale.errors import InputError
from seg_at_scale.io import RasterReader
from seg_at_scale.tiling import Window

H, W = 2000, 300


@pytest.mark.parametrize("planar", [False, True], ids=["interleaved", "planar"])
def test_single_strip_uncompressed_reads_only_the_window(tmp_path: Path, planar: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    array = make_array((3, H, W), "uint16")
    path = tmp_path / "strip.tif"
    data = array if planar else np.moveaxis(array, 0, -1)
    tifffile.imwrite(path, data, rowsperstrip=H, planarconfig="separate" if planar else "contig",
                     photometric="rgb")
    window = Window(1500, 40, 64, 100)
    monkeypatch.setattr(raster_mod, "_open_binary", lambda p: CountingFile(p, "rb"))
    CountingFile.count = 0
    with RasterReader(path) as r:
        assert r.layout.contiguous is not None and r.layout.seg == (H, W)
        np.testing.assert_array_equal(r.read(window), array[(slice(None), *window.slices())])
        # the window's own samples, not the 3.6 MB strip
        assert r.bytes_read == 3 * 64 * 100 * 2
    assert CountingFile.count < 20_000  # header and tags only


def test_big_endian_striped_file_is_mapped_in_its_byte_order(tmp_path: Path) -> None:
    array = make_array((2, 100, 70), "float32")
    path = tmp_path / "be.tif"
    tifffile.imwrite(path, np.moveaxis(array, 0, -1), byteorder=">", rowsperstrip=7,
                     planarconfig="contig")
    with RasterReader(path) as r:
        assert r.layout.contiguous is not None
        out = r.read(Window(-3, 60, 20, 20), fill="reflect")
        assert out.dtype == np.float32 and out.dtype.isnative
    padded = np.pad(array, ((0, 0), (3, 0), (0, 10)), mode="reflect")
    np.testing.assert_array_equal(out, padded[:, 0:20, 60:80])


@pytest.mark.parametrize("kind", ["tiled", "strips", "mapped"])
@pytest.mark.parametrize("planar", [False, True], ids=["interleaved", "planar"])
def test_windows_are_band_after_band_or_in_the_files_pixel_order(tmp_path: Path, kind: str,
                                                                 planar: bool) -> None:
    """A window is ``[C, h, w]`` band after band in memory (numpy's per-band arithmetic
    runs along rows), or with ``pixels=True`` over an interleaved file's ``[h, w, C]``
    memory, as its segments decode (placing them and casting the window into a
    channels-last batch are then plain copies). Inside the image and across its borders
    with either fill, from decoded tiles, decoded strips and a memory map, the samples are
    the image's."""
    from seg_at_scale.tiling.engine import _as_tensor

    array = make_array((3, 101, 77), "uint16")
    path = tmp_path / f"{kind}.tif"
    layout = {"tiled": {"tile": (32, 32), "compression": "zlib"},
              "strips": {"rowsperstrip": 9, "compression": "zlib"},
              "mapped": {"rowsperstrip": 9}}[kind]
    tifffile.imwrite(path, array if planar else np.moveaxis(array, 0, -1), photometric="rgb",
                     planarconfig="separate" if planar else "contig", **layout)
    padded = {fill: np.pad(array, ((0, 0), (20, 20), (20, 20)),
                           mode="reflect" if fill == "reflect" else "constant")
              for fill in ("reflect", "constant")}
    with RasterReader(path) as r:
        assert (r.layout.contiguous is not None) == (kind == "mapped")
        for window in (Window(30, 9, 40, 50), Window(-20, -20, 60, 61), Window(70, 50, 51, 47)):
            for fill in ("reflect", "constant"):
                want = padded[fill][:, window.row + 20:window.row_end + 20,
                                    window.col + 20:window.col_end + 20]
                out = r.read(window, fill=fill)
                np.testing.assert_array_equal(out, want)
                assert out.flags.c_contiguous, (window, fill)
                out = r.read(window, fill=fill, pixels=True)
                np.testing.assert_array_equal(out, want)
                memory = out if planar else out.transpose(1, 2, 0)
                assert memory.flags.c_contiguous, (window, fill)
                # the engine's tensor shares the window's memory and layout
                t = _as_tensor(out)
                assert t.data_ptr() == out.ctypes.data and t.stride() == tuple(
                    s // out.itemsize for s in out.strides)
        out.flags.writeable = False  # torch cannot share it: a copy in the same layout
        t = _as_tensor(out)
        assert t.data_ptr() != out.ctypes.data and torch.equal(t, torch.from_numpy(out.copy()))
        assert t.stride() == tuple(s // out.itemsize for s in out.strides)


def test_huge_compressed_strip_warns_once_with_the_fix(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    array = make_array((1, 4096, 1100), "uint8")
    path = tmp_path / "one_strip.tif"
    tifffile.imwrite(path, array[0], rowsperstrip=4096, compression="zlib")
    raster_mod._warned.discard(path)
    # a strip the reader's cache holds is decoded once for every window: no warning
    with caplog.at_level(logging.WARNING), RasterReader(path) as r:
        for row in (0, 700, 2000):
            np.testing.assert_array_equal(r.read(Window(row, 0, 100, 100))[0],
                                          array[0, row:row + 100, :100])
        assert r.segments[False].misses == 1
    assert not [m for m in caplog.messages if "one_strip.tif" in m]
    with caplog.at_level(logging.WARNING), RasterReader(path) as r:
        r.segments[False].max_bytes = 1 << 20  # smaller than the strip: decoded per window
        assert r.layout.contiguous is None
        for row in (0, 700, 2000):
            np.testing.assert_array_equal(r.read(Window(row, 0, 100, 100))[0],
                                          array[0, row:row + 100, :100])
    warnings = [m for m in caplog.messages if "one_strip.tif" in m]
    assert len(warnings) == 1
    assert "gdal_translate -co TILED=YES" in warnings[0] and "4096x1100" in warnings[0]


def test_tiled_file_read_in_tiles_does_not_warn(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tiled.tif"
    tifffile.imwrite(path, make_array((2048, 2048), "uint8"), tile=(256, 256),
                     compression="zlib")
    with caplog.at_level(logging.WARNING), RasterReader(path) as r:
        r.read(Window(0, 0, 512, 512))
    assert not caplog.messages


@pytest.mark.parametrize("max_bytes", [96 << 20, 3 * 128 * 128 * 4], ids=["default", "small"])
def test_overlapping_windows_decode_a_shared_segment_once(tmp_path: Path, max_bytes: int,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The windows of a tile grid overlap by twice the halo: a segment under the overlap
    is decoded for the first window that needs it and taken from the reader's cache by
    the next, whatever the cache's size (a small one drops segments and decodes again);
    every window equals the image's pixels, reflect padding at the borders included."""
    array = make_array((4, 1000, 900), "uint8")  # 8 x 8 tiles of 128, the last ones cut
    path = tmp_path / "tiled.tif"
    tifffile.imwrite(path, np.moveaxis(array, 0, -1), tile=(128, 128), compression="zlib",
                     photometric="rgb", extrasamples=[0])
    padded = np.pad(array, ((0, 0), (46, 46), (46, 46)), mode="reflect")
    windows = [Window(r - 46, c - 46, min(300, 1000 - r) + 92, min(300, 900 - c) + 92)
               for r in range(0, 1000, 300) for c in range(0, 900, 300)]  # cores of 300
    with RasterReader(path) as r:
        decoded: list[int] = []
        real = r._decode
        monkeypatch.setattr(r, "_decode", lambda data, k, **kw: (decoded.append(k),
                                                                  real(data, k, **kw))[1])
        r.segments[False].max_bytes = max_bytes
        for w in windows:
            np.testing.assert_array_equal(r.read(w, fill="reflect"), padded[
                :, w.row + 46:w.row_end + 46, w.col + 46:w.col_end + 46])
        touched = {k for w in windows for k in r.layout.segments(
            max(w.row, 0), min(w.row_end, 1000), max(w.col, 0), min(w.col_end, 900))}
        if max_bytes > 1 << 20:
            assert sorted(decoded) == sorted(touched)  # each once
            assert r.segments[False].hits > 0
        else:
            assert len(decoded) > len(touched) and r.segments[False].nbytes <= max_bytes
    assert r.segments[False].nbytes == 0  # closing frees them


# ----- GDAL internal masks --------------------------------------------------------------

rasterio = pytest.importorskip("rasterio")


def write_cog(path: Path, image: np.ndarray, valid: np.ndarray) -> Path:
    """A Cloud-Optimized GeoTIFF from rio-cogeo: overviews, each with its reduced mask."""
    from rio_cogeo.cogeo import cog_translate
    from rio_cogeo.profiles import cog_profiles

    source = write_with_gdal_mask(path.with_suffix(".src.tif"), image, valid)
    profile = {**cog_profiles.get("deflate"), "blockxsize": 64, "blockysize": 64}
    cog_translate(source, path, profile, overview_level=2, quiet=True)
    return path


def write_8bit_mask(path: Path, image: np.ndarray, valid: np.ndarray) -> Path:
    """The 8-bit form of the mask IFD (0 / 255), as other GDAL versions and tools write."""
    tifffile.imwrite(path, np.moveaxis(image, 0, -1), photometric="rgb", tile=(64, 64),
                     compression="zlib")
    # tifffile writes only 1-bit MASK pages: tag NewSubfileType (254) = 4 by hand
    tifffile.imwrite(path, np.where(valid, 255, 0).astype(np.uint8), append=True,
                     photometric="minisblack", tile=(64, 64), compression="zlib",
                     extratags=[(254, "I", 1, 4, True)])
    return path


WRITERS = {
    "gdal-deflate": lambda p, i, v: write_with_gdal_mask(
        p, i, v, tiled=True, blockxsize=64, blockysize=64, compress="deflate"),
    "gdal-jpeg": lambda p, i, v: write_with_gdal_mask(
        p, i, v, tiled=True, blockxsize=64, blockysize=64, compress="jpeg",
        photometric="ycbcr"),
    "gdal-raw-strips": write_with_gdal_mask,  # uncompressed strips: the image is mapped
    "cog": write_cog,
    "8-bit": write_8bit_mask,
}


@pytest.mark.parametrize("writer", WRITERS)
def test_internal_mask_is_read(tmp_path: Path, writer: str) -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, (3, 150, 130), dtype=np.uint8)
    valid = np.ones((150, 130), bool)
    valid[:40, :55] = False
    valid[100:, 90:] = False
    path = WRITERS[writer](tmp_path / "m.tif", image, valid)
    with rasterio.open(path) as ds:  # GDAL's own reading of the mask
        np.testing.assert_array_equal(ds.dataset_mask() > 0, valid)
    with RasterReader(path) as r:
        assert r.has_mask and r.bands == 3
        np.testing.assert_array_equal(r.read_mask(Window(0, 0, 150, 130)), valid)
        inner = Window(30, 50, 80, 60)
        np.testing.assert_array_equal(r.read_mask(inner), valid[inner.slices()])
        reflected = r.read_mask(Window(-10, -10, 30, 30), fill="reflect")
        np.testing.assert_array_equal(reflected, np.pad(valid, 10, mode="reflect")[:30, :30])
        assert r.read_mask(Window(-10, -10, 30, 30), fill="constant")[:10].all()
        if writer != "gdal-jpeg":  # lossless (rio-cogeo zeroes the masked pixels)
            keep = valid[inner.slices()]
            np.testing.assert_array_equal(r.read(inner)[:, keep],
                                          image[(slice(None), *inner.slices())][:, keep])
        assert (r.layout.contiguous is not None) == (writer == "gdal-raw-strips")


def test_file_without_mask_has_none(tmp_path: Path) -> None:
    path = tmp_path / "plain.tif"
    tifffile.imwrite(path, make_array((40, 30), "uint8"))
    with RasterReader(path) as r:
        assert not r.has_mask and r.read_mask(Window(0, 0, 5, 5)) is None


def test_masked_pixels_are_no_data_where_prediction_and_training_read(tmp_path: Path) -> None:
    from seg_at_scale.io.valid import read_valid

    image = np.full((3, 80, 60), 7, np.uint8)
    valid = np.ones((80, 60), bool)
    valid[10:30, 5:25] = False
    path = write_with_gdal_mask(tmp_path / "m.tif", image, valid, compress="deflate")
    with RasterReader(path) as r:
        _, invalid = read_valid(r, Window(-4, -4, 88, 68), "constant")
    assert invalid is not None
    np.testing.assert_array_equal(invalid[4:-4, 4:-4], ~valid)


def test_masked_pixels_are_predicted_255_and_ignored_in_training(tmp_path: Path) -> None:
    import torch
    import zarr

    from seg_at_scale.data.normalize import Normalizer
    from seg_at_scale.data.scenes import Scene, validate_scene
    from seg_at_scale.data.tiles import GridTiles
    from seg_at_scale.io import write_raster
    from seg_at_scale.models import UNet
    from seg_at_scale.prediction import predict_raster
    from seg_at_scale.prediction.options import PredictOptions

    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, (4, 90, 70)).astype(np.uint8)
    valid = np.ones((90, 70), bool)
    valid[10:30, 5:25] = False
    path = write_with_gdal_mask(tmp_path / "m_image.tif", image, valid, compress="deflate")
    torch.manual_seed(0)
    net = UNet(4, 3, levels=2, base_width=4).eval()
    predict_raster(net, path, tmp_path / "m.zarr",
                   PredictOptions(tile_size=48, progress=False))
    labels = zarr.open_group(tmp_path / "m.zarr", mode="r")["labels"][:]
    assert (labels[~valid] == 255).all() and (labels[valid] < 3).all()
    mask = write_raster(tmp_path / "m_mask.tif", np.ones((90, 70), np.uint8))
    scene = validate_scene(Scene(path, mask), num_classes=3)
    ds = GridTiles([scene], net.footprint(), Normalizer(), q=1)
    target = ds[0]["target"].numpy()[:90, :70]
    assert (target[~valid] == 255).all() and (target[valid] == 1).all()


@pytest.mark.parametrize("kind", ["deflate-tiles", "raw-strips", "vrt"])
def test_windows_across_the_border_equal_the_definition_at_every_reach(tmp_path: Path,
                                                                        kind: str) -> None:
    """A window reaching outside the image is decoded into place and its reflected margins
    copied from its own inside part, or (a reflection whose sources lie outside that part)
    gathered from a box: either way each pixel is the image's at ``source_indices``, for the
    samples and GDAL's mask, band after band and in the file's pixel order, from decoded
    tiles, a memory map and GDAL (a VRT). Sizes are odd; windows hug the corners, reach
    past a whole image side (a repeated reflection) and lie wholly outside."""
    import rasterio.shutil as rasterio_shutil
    from rasterio.windows import Window as GdalWindow

    from seg_at_scale.tiling.geometry import source_indices

    rng = np.random.default_rng(3)
    image = rng.integers(0, 60000, (3, 45, 37), dtype=np.uint16)
    valid = rng.random((45, 37)) > 0.3
    valid[:16] = False  # no data in the mask's first row of tiles, which GDAL may leave out
    if kind == "deflate-tiles":  # sparse: those tiles never written (offset 0)
        with rasterio.Env(GDAL_TIFF_INTERNAL_MASK=True), rasterio.open(
                tmp_path / "m.tif", "w", driver="GTiff", width=37, height=45, count=3,
                dtype="uint16", tiled=True, blockxsize=16, blockysize=16, compress="deflate",
                sparse_ok=True) as ds:
            ds.write(image)
            ds.write_mask(np.where(valid[16:], 255, 0).astype(np.uint8),
                          window=GdalWindow(0, 16, 37, 29))
        path = tmp_path / "m.tif"
        assert 0 in tifffile.TiffFile(path).pages[1].dataoffsets
    else:
        path = write_with_gdal_mask(tmp_path / "m.tif", image, valid)
    if kind == "vrt":
        rasterio_shutil.copy(path, tmp_path / "m.vrt", driver="VRT")
        path = tmp_path / "m.vrt"
    windows = [Window(-9, -7, 30, 25), Window(20, 15, 33, 30), Window(-3, 30, 51, 12),
               Window(-50, -40, 140, 120), Window(-12, -12, 14, 14), Window(43, 35, 20, 20),
               Window(-30, 5, 10, 10), Window(50, -20, 7, 90), Window(-1, -1, 47, 39)]
    with RasterReader(path) as r:
        assert r.has_mask
        for w in windows:
            for fill in ("reflect", "constant"):
                rows = source_indices(w.row, w.height, 45, fill)
                cols = source_indices(w.col, w.width, 37, fill)
                outside = (rows < 0)[:, None] | (cols < 0)[None, :]
                want = image[:, rows][:, :, cols]
                want[:, outside] = 0
                want_mask = valid[rows][:, cols] | outside
                for pixels in (False, True):
                    np.testing.assert_array_equal(r.read(w, fill=fill, pixels=pixels), want,
                                                  err_msg=f"{kind} {w} {fill} {pixels}")
                np.testing.assert_array_equal(r.read_mask(w, fill=fill), want_mask,
                                              err_msg=f"{kind} {w} {fill} mask")


@pytest.mark.parametrize("second", [(40, 30), (25, 17)])
def test_a_tiff_of_several_images_is_refused_with_the_way_to_split_it(
        tmp_path: Path, second: tuple[int, int]) -> None:
    """A multi-page TIFF (a time series, a scanner's stack) is not read as its first page."""
    path = tmp_path / "pages.tif"
    with tifffile.TiffWriter(path) as tif:
        tif.write(make_array((40, 30), "uint8"))
        tif.write(make_array(second, "uint8"))  # a second full-resolution image
    with pytest.raises(InputError, match=r"pages\.tif' holds 2 images.*GTIFF_DIR:2:"):
        RasterReader(path)


def test_reduced_and_mask_pages_are_not_other_images(tmp_path: Path) -> None:
    path = tmp_path / "overviews.tif"
    image = make_array((64, 48), "uint8")
    with tifffile.TiffWriter(path) as tif:
        tif.write(image, tile=(16, 16))
        tif.write(image[::2, ::2], tile=(16, 16), subfiletype=1)  # an overview
        tif.write(np.ones((64, 48), bool), tile=(16, 16), subfiletype=4)  # a mask
    with RasterReader(path) as r:
        assert r.has_mask
        np.testing.assert_array_equal(r.read(Window(0, 0, 64, 48))[0], image)
