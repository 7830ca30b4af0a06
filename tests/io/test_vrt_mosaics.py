"""Mosaics of an archive's outputs: one VRT per CRS, named once; unreferenced rasters out."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import rasterio
from rasterio.crs import CRS
from rasterio.transform import from_origin

from seg_at_scale.io.vrt import write_mosaics


def _label(path: Path, crs: CRS | None, transform, height: int = 8, width: int = 8) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = {"crs": crs, "transform": transform} if crs is not None else {}
        with rasterio.open(path, "w", driver="GTiff", height=height, width=width, count=1,
                           dtype="uint8", nodata=255, **kw) as ds:
            ds.write(np.full((1, height, width), int(path.stem[1:]), np.uint8))
            ds.write_colormap(1, {0: (1, 2, 3, 255)})  # as the labels' COGs have
    return path


def test_crss_without_epsg_get_one_mosaic_each(tmp_path):
    lcc = "+proj=lcc +lat_1={} +lat_2={} +lat_0={} +lon_0={} +ellps=WGS84 +units=m"
    a, b = CRS.from_proj4(lcc.format(40, 50, 45, 10)), CRS.from_proj4(lcc.format(30, 35, 32, -20))
    assert a.to_epsg() is None and b.to_epsg() is None
    paths = [_label(tmp_path / f"s{k}.tif", crs, from_origin(1000 * k, 0, 10, 10))
             for k, crs in enumerate([a, b, a, b])]
    vrts = write_mosaics(paths, tmp_path)
    assert len(set(vrts)) == 2 and sorted(tmp_path.glob("*.vrt")) == sorted(vrts)
    for vrt in vrts:
        with rasterio.open(vrt) as ds:
            values = set(np.unique(ds.read(1))) - {255}
            assert values in ({0, 2}, {1, 3}) and CRS.from_wkt(ds.crs.to_wkt()) in (a, b)


def test_outputs_without_georeferencing_make_no_mosaic(tmp_path):
    paths = [_label(tmp_path / "s0.tif", None, None, 50, 40),
             _label(tmp_path / "s1.tif", None, None, 20, 30)]
    assert write_mosaics(paths, tmp_path) == [] and not list(tmp_path.glob("*.vrt"))


def test_a_rotated_output_is_left_out_of_the_mosaic_and_named(tmp_path, caplog):
    """Before: one scene with a rotated geotransform ended every archive run with exit 2
    after all its work ("is not north-up"), with no summary.json or items.json."""
    from affine import Affine

    utm = CRS.from_epsg(32633)
    paths = [_label(tmp_path / "s1.tif", utm, from_origin(500000, 4500000, 10, 10)),
             _label(tmp_path / "s2.tif", utm, Affine(8.0, 3.0, 500100, 3.0, -8.0, 4500000)),
             _label(tmp_path / "s3.tif", utm, from_origin(500080, 4500000, 10, 10))]
    with caplog.at_level("WARNING", logger="seg_at_scale.io.vrt"):
        (vrt,) = write_mosaics(paths, tmp_path)
    assert [r.getMessage() for r in caplog.records] == [
        f"{paths[1]} left out of the mosaic: its geotransform is rotated (a VRT mosaic places "
        "north-up rasters)"]
    with rasterio.open(vrt) as ds:
        assert sorted(Path(f).name for f in ds.files[1:]) == ["s1.tif", "s3.tif"]
        assert ds.width == 16 and set(np.unique(ds.read(1))) == {1, 3}
