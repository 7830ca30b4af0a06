"""Rasters that are not TIFFs (a VRT mosaic of tiles, ERDAS Imagine) read through GDAL.

The reference is the whole scene the mosaic is cut from, read by the TIFF reader: every
window (across the pieces' seams, at the borders, outside with either fill) is equal.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import rasterio
from helpers.io import make_array

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


def test_the_mosaic_carries_its_georeferencing_to_outputs(tmp_path):
    """The VRT's CRS and transform, as GeoTIFF tags, give a TIFF GDAL places where the VRT is."""
    image = make_array((3, H, W), "uint8")
    _, vrt, _ = _mosaic(tmp_path, image)
    with RasterReader(vrt) as mosaic:
        out = write_raster(tmp_path / "labels.tif", image[:1], geotags=mosaic.geotags)
    with rasterio.open(vrt) as a, rasterio.open(out) as b:
        assert a.crs == b.crs and a.transform == b.transform


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
    with pytest.raises(InputError) as err:
        RasterReader(vrt)
    assert str(err.value) == (f"'{vrt}' has a different no-data value per band (0.0, "
                              "-9999.0); pass nodata=<value> for all of them")
    with RasterReader(vrt, nodata=-9999) as mosaic:
        assert mosaic.nodata == -9999


def test_a_missing_source_is_named_when_the_mosaic_is_opened(tmp_path):
    _, vrt, pieces = _mosaic(tmp_path, make_array((2, H, W), "uint8"))
    pieces[2].unlink()
    with pytest.raises(InputError) as err:
        RasterReader(vrt)
    assert str(err.value) == (f"'{vrt}' reads '{pieces[2]}', which does not exist (1 of its "
                              "4 files missing); restore them or rebuild it (e.g. gdalbuildvrt)")


def test_other_gdal_formats_and_what_gdal_cannot_read(tmp_path):
    image = make_array((3, H, W), "uint16")
    img = tmp_path / "scene.img"
    with rasterio.open(img, "w", driver="HFA", width=W, height=H, count=3, dtype="uint16",
                       crs="EPSG:32633", transform=rasterio.Affine(10, 0, 5e5, 0, -10, 45e5)
                       ) as ds:
        ds.write(image)
    np.testing.assert_array_equal(read_raster(img), image)
    with RasterReader(img) as reader:
        assert reader.files[0] == img and not reader.geotags.is_empty
    junk = tmp_path / "notes.tif"
    junk.write_text("not a raster")
    with pytest.raises(InputError) as err:
        RasterReader(junk)
    assert str(err.value).startswith(f"cannot read '{junk}' as a raster: it is not a TIFF, "
                                     "and GDAL says: ")
    assert str(err.value).endswith("Check the path, or re-create / re-copy the file.")
