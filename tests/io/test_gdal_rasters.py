"""Rasters that are not TIFFs (a VRT mosaic of tiles, ERDAS Imagine) read through GDAL.

The reference is the whole scene the mosaic is cut from, read by the TIFF reader: every
window (across the pieces' seams, at the borders, outside with either fill) is equal.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import rasterio
from affine import Affine
from helpers.io import make_array
from rasterio.control import GroundControlPoint
from rasterio.crs import CRS
from rasterio.enums import ColorInterp
from rasterio.errors import NotGeoreferencedWarning

from seg_at_scale.errors import InputError
from seg_at_scale.io import RasterReader, example_geotags, read_raster, write_raster
from seg_at_scale.io.raster import GdalReader, raster_files
from seg_at_scale.io.vrt import write_vrt
from seg_at_scale.tiling.geometry import Window

H, W = 301, 257
ROWS, COLS = (0, 118, H), (0, 97, W)  # a 2 x 2 mosaic of uneven pieces
WINDOWS = [
    Window(0, 0, H, W),
    Window(117, 96, 3, 3),  # the four pieces meet
    Window(100, 50, 40, 150),  # across both seams
    Window(290, 250, 11, 7),  # the bottom-right corner
    Window(-20, -33, 90, 60),  # outside, top-left
    Window(280, 240, 45, 40),  # outside, bottom-right
]


def _mosaic(tmp_path: Path, image: np.ndarray, nodata: float | None = None
            ) -> tuple[Path, Path, list[Path]]:
    """The scene as one GeoTIFF, and as a VRT of four GeoTIFF pieces (origin 500000, 4500000,
    10 m pixels)."""
    whole = write_raster(tmp_path / "whole.tif", image, tile=(64, 48), nodata=nodata,
                         geotags=example_geotags(pixel_size=10.0))
    pieces = []
    for i in range(2):
        for j in range(2):
            r0, r1, c0, c1 = ROWS[i], ROWS[i + 1], COLS[j], COLS[j + 1]
            origin = (500000.0 + 10.0 * c0, 4500000.0 - 10.0 * r0)
            pieces.append(write_raster(tmp_path / f"piece_{i}{j}.tif", image[:, r0:r1, c0:c1],
                                       nodata=nodata,
                                       geotags=example_geotags(origin, pixel_size=10.0)))
    return whole, write_vrt(pieces, tmp_path / "mosaic.vrt"), pieces


@pytest.mark.parametrize("dtype", ["uint16", "float32"])
def test_a_vrt_mosaic_reads_as_the_scene_it_is_cut_from(tmp_path, dtype):
    image = make_array((4, H, W), dtype)
    whole, vrt, pieces = _mosaic(tmp_path, image)
    with RasterReader(whole) as tif, RasterReader(vrt) as mosaic:
        assert isinstance(mosaic, GdalReader) and not isinstance(tif, GdalReader)
        assert (mosaic.shape, mosaic.dtype, mosaic.nodata, mosaic.has_mask) == \
            (tif.shape, tif.dtype, None, False)
        assert mosaic.files == [vrt, *pieces] and raster_files(vrt) == [vrt, *pieces]
        for window in WINDOWS:
            for fill in ("reflect", "constant"):
                np.testing.assert_array_equal(mosaic.read(window, fill=fill),
                                              tif.read(window, fill=fill))
                np.testing.assert_array_equal(mosaic.read(window, fill=fill, pixels=True),
                                              tif.read(window, fill=fill, pixels=True))
        with pytest.raises(InputError, match="reaches outside"):
            mosaic.read(WINDOWS[-1])
        again = pickle.loads(pickle.dumps(mosaic))
        assert isinstance(again, GdalReader)
        np.testing.assert_array_equal(again.read(WINDOWS[2]), tif.read(WINDOWS[2]))
        again.close()
    with rasterio.open(vrt) as a, rasterio.open(whole) as b:  # GDAL's own view agrees
        assert (a.crs, a.transform) == (b.crs, b.transform)


def test_pieces_read_through_their_alpha_band_are_refused_with_the_fix(tmp_path):
    """``gdalbuildvrt`` of 4-band pieces whose band 4 is tagged alpha (tifffile, PIL and many
    tools tag it so) composites them: GDAL zeroes bands 1-3 where band 4 is 0, and the VRT
    would be predicted unlike its pieces. Refused naming the fix; after it, the scene."""
    image = make_array((4, H, W), "uint8")
    image[3, ::7, ::5] = 0  # the "alpha" (a NIR band) is 0 here and there, at the seams too
    whole, vrt, pieces = _mosaic(tmp_path, image)
    for piece in pieces:
        with rasterio.open(piece, "r+") as ds:
            ds.colorinterp = [ColorInterp.red, ColorInterp.green, ColorInterp.blue,
                              ColorInterp.alpha]
    plain = vrt.read_text()
    vrt.write_text(plain.replace("<SimpleSource>", "<ComplexSource>").replace(
        "</SimpleSource>", "\n<UseMaskBand>true</UseMaskBand>\n</ComplexSource>"))
    with rasterio.open(vrt) as ds:  # what GDAL makes of it: not the scene
        assert (ds.read()[:3] != image[:3]).any()
    with pytest.raises(InputError) as err:
        RasterReader(vrt)
    assert str(err.value).startswith(
        f"'{vrt}' reads band 1 of '{pieces[0]}' through its band 4, tagged alpha "
        "(<UseMaskBand>true</UseMaskBand>): GDAL gives 0 where that hides a pixel")
    assert f"delete those lines (`sed -i '/<UseMaskBand>/d' {vrt}`)" in str(err.value)
    assert "pass nodata=0 or rebuild it with `gdalbuildvrt -vrtnodata 0`" in str(err.value)
    with RasterReader(vrt, nodata=0) as mosaic:  # those pixels are no data: all bands 0
        assert mosaic.nodata == 0
    vrt.write_text("".join(line for line in vrt.read_text().splitlines(keepends=True)
                           if "<UseMaskBand>" not in line))  # the fix's sed
    with RasterReader(whole) as tif, RasterReader(vrt) as mosaic:
        np.testing.assert_array_equal(mosaic.read(WINDOWS[0]), tif.read(WINDOWS[0]))
        np.testing.assert_array_equal(mosaic.read(WINDOWS[1]), tif.read(WINDOWS[1]))


def _hfa(path: Path, image: np.ndarray, **georeference) -> Path:
    """``image`` as an ERDAS Imagine file; ``gcps=`` sets ground control points instead."""
    gcps = georeference.pop("gcps", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGeoreferencedWarning)
        with rasterio.open(path, "w", driver="HFA", width=image.shape[2],
                           height=image.shape[1], count=image.shape[0], dtype=image.dtype,
                           **georeference) as ds:
            ds.write(image)
            if gcps:
                ds.gcps = (gcps, CRS.from_epsg(32633))
    return path


@pytest.mark.parametrize("kind", ["mosaic", "rotated", "gcps"])
def test_the_georeferencing_is_carried_to_outputs(tmp_path, kind):
    """GDAL's CRS and transform (rotated too) or ground control points, as GeoTIFF tags,
    give a TIFF GDAL places where the input is."""
    image = make_array((3, H, W), "uint8")
    if kind == "mosaic":
        _, src, _ = _mosaic(tmp_path, image)
    elif kind == "rotated":
        src = _hfa(tmp_path / "r.img", image, crs="EPSG:32633",
                   transform=Affine(10, 0.5, 5e5, 0.25, -10, 45e5))
    else:
        src = _hfa(tmp_path / "g.img", image, gcps=[
            GroundControlPoint(0, 0, 5e5, 45e5), GroundControlPoint(0, W, 5e5 + W, 45e5),
            GroundControlPoint(H, 0, 5e5, 45e5 - H),
            GroundControlPoint(H, W, 5e5 + W + 7, 45e5 - H - 3)])
    with RasterReader(src) as reader:
        assert isinstance(reader, GdalReader) and not reader.geotags.is_empty
        out = write_raster(tmp_path / "labels.tif", image[:1], geotags=reader.geotags)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGeoreferencedWarning)
        with rasterio.open(src) as a, rasterio.open(out) as b:
            assert (a.crs, a.transform) == (b.crs, b.transform)
            where = [[(g.row, g.col, g.x, g.y) for g in ds.gcps[0]] for ds in (a, b)]
            assert where[0] == where[1] and a.gcps[1] == b.gcps[1]
            assert len(where[0]) == (4 if kind == "gcps" else 0)


def test_no_data_of_the_bands_and_its_override(tmp_path):
    image = make_array((2, H, W), "int16")
    _, vrt, _ = _mosaic(tmp_path, image, nodata=-9999)
    with RasterReader(vrt) as mosaic:
        assert mosaic.nodata == -9999.0 and not mosaic.has_mask
    with RasterReader(vrt, nodata=7) as mosaic:
        assert mosaic.nodata == 7
    text = vrt.read_text()
    first = text.index("<NoDataValue>-9999.0</NoDataValue>")
    vrt.write_text(text[:first] + "<NoDataValue>0.0</NoDataValue>"
                   + text[first + len("<NoDataValue>-9999.0</NoDataValue>"):])
    with RasterReader(vrt) as mosaic:  # opened for its size or files: no value needed
        assert (mosaic.height, mosaic.width, mosaic.bands) == (H, W, 2)
        with pytest.raises(InputError) as err:
            mosaic.nodata  # noqa: B018 - asked for: refused
    assert str(err.value) == (f"'{vrt}' has a different no-data value per band (0.0, "
                              "-9999.0); pass nodata=<value> for all of them")
    with RasterReader(vrt, nodata=-9999) as mosaic:
        assert mosaic.nodata == -9999


def test_a_truncated_source_is_named_by_the_window_that_reads_it(tmp_path):
    _, vrt, pieces = _mosaic(tmp_path, make_array((2, H, W), "uint8"))
    with open(pieces[3], "r+b") as fh:
        fh.truncate(pieces[3].stat().st_size // 2)
    with RasterReader(vrt) as mosaic:
        mosaic.read(Window(0, 0, 100, 90))  # the first piece's
        with pytest.raises(InputError) as err:
            mosaic.read(Window(H - 40, W - 40, 40, 40))
    message = str(err.value)
    assert message.startswith(f"cannot read rows {H - 40}:{H}, cols {W - 40}:{W} of '{vrt}': ")
    assert pieces[3].name in message and ".." not in message
    assert message.endswith(". Re-copy or re-generate the file (and its sources).")


def test_a_missing_source_is_named_when_the_mosaic_is_opened(tmp_path):
    _, vrt, pieces = _mosaic(tmp_path, make_array((2, H, W), "uint8"))
    pieces[2].unlink()
    with pytest.raises(InputError) as err:
        RasterReader(vrt)
    assert str(err.value) == (f"'{vrt}' reads '{pieces[2]}', which does not exist (1 of its "
                              "4 files missing); restore them or rebuild it (e.g. gdalbuildvrt)")


def test_other_gdal_formats_and_what_gdal_cannot_read(tmp_path):
    image = make_array((3, H, W), "uint16")
    img = _hfa(tmp_path / "scene.img", image)  # no georeferencing
    np.testing.assert_array_equal(read_raster(img), image)
    with RasterReader(img) as reader:
        assert reader.files[0] == img and reader.geotags.is_empty
    junk = tmp_path / "notes.tif"
    junk.write_text("not a raster")
    with pytest.raises(InputError) as err:
        RasterReader(junk)
    assert str(err.value).startswith(f"cannot read '{junk}' as a raster: it is not a TIFF, "
                                     "and GDAL says: ")
    assert str(err.value).endswith("Check the path, or re-create / re-copy the file.")


def test_gdals_per_dataset_mask_is_the_mask(tmp_path):
    """A VRT of a GeoTIFF with an internal mask: its mask band is ``read_mask``'s, as the
    TIFF reader reads the TIFF's own, with either fill outside."""
    import rasterio.shutil

    image = make_array((3, H, W), "uint8")
    valid = np.full((H, W), 255, np.uint8)
    valid[50:120, 30:90] = 0
    valid[-7:, -5:] = 0  # at the corner
    tif = tmp_path / "masked.tif"
    with rasterio.Env(GDAL_TIFF_INTERNAL_MASK=True), rasterio.open(
            tif, "w", driver="GTiff", width=W, height=H, count=3, dtype="uint8", tiled=True,
            blockxsize=64, blockysize=64, crs="EPSG:32633",
            transform=Affine(1, 0, 5e5, 0, -1, 45e5)) as ds:
        ds.write(image)
        ds.write_mask(valid)
    vrt = tmp_path / "masked.vrt"
    rasterio.shutil.copy(tif, vrt, driver="VRT")
    with RasterReader(tif) as a, RasterReader(vrt) as b:
        assert isinstance(b, GdalReader) and a.has_mask and b.has_mask
        for window in WINDOWS:
            for fill in ("reflect", "constant"):
                mask = b.read_mask(window, fill=fill)
                np.testing.assert_array_equal(mask, a.read_mask(window, fill=fill))
        assert not b.read_mask(Window(0, 0, H, W)).all()


def test_a_container_of_rasters_names_them_and_the_fix(tmp_path):
    """HDF5 (as NetCDF) holds several rasters: refused naming them and how to take one."""
    import h5py

    path = tmp_path / "planes.h5"
    with h5py.File(path, "w") as f:
        for name in ("u", "v", "w", "t"):
            f[name] = np.zeros((30, 40), np.float32)
    with pytest.raises(InputError) as err:
        RasterReader(path)
    assert str(err.value) == (
        f"'{path}' holds 4 rasters (GDAL subdatasets: HDF5:{path}://t, HDF5:{path}://u, "
        f"HDF5:{path}://v, ...), not one; write the one to predict as a GeoTIFF, e.g. "
        f"`gdal_translate 'HDF5:{path}://t' planes.tif`")
