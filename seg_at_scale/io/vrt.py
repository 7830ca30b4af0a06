"""A GDAL virtual mosaic (VRT) of rasters, so an archive opens as one layer.

What ``gdalbuildvrt`` writes for north-up rasters of one CRS and band count: a
``VRTDataset`` covering the union of their extents at the finest pixel size, per band one
``SimpleSource`` per file placed by its geotransform, the nodata value and (one band) the
colour table of the first file. ``seg-predict`` writes one over an archive's label rasters;
a mosaic of image tiles is read back as one scene (:class:`~seg_at_scale.io.raster.GdalReader`).
GDAL's command-line tools are not a dependency (rasterio wheels carry
the library, not the programs), so the XML is written here with ``xml.etree`` following
GDAL's VRT format; rasterio (GDAL) reads it back in the tests.

>>> from affine import Affine
>>> _window(Affine(1, 0, 10, 0, -1, 20), Affine(1, 0, 0, 0, -1, 30), 5, 4)
(10.0, 10.0, 4.0, 5.0)
"""

from __future__ import annotations

import logging
import os
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from affine import Affine

from seg_at_scale.errors import InputError
from seg_at_scale.io.geotags import open_dataset

__all__ = ["masked_sources", "write_mosaics", "write_vrt", "written_mosaic"]

MOSAIC_MARK = "seg_at_scale archive mosaic"  # the VRT's dataset metadata ``written_by``

log = logging.getLogger(__name__)


def _window(src: Affine, dst: Affine, height: int, width: int
            ) -> tuple[float, float, float, float]:
    """``(x_off, y_off, x_size, y_size)`` of a source raster in the mosaic's pixel grid."""
    x_off = (src.c - dst.c) / dst.a
    y_off = (src.f - dst.f) / dst.e
    return x_off, y_off, width * src.a / dst.a, height * src.e / dst.e


def _describe(path: Path) -> dict[str, Any]:
    with open_dataset(path) as ds:
        if _rotated(ds.transform):
            raise InputError(f"'{path}' is not north-up (a rotated geotransform); a mosaic "
                             "needs north-up rasters")
        colours = ds.colormap(1) if ds.count == 1 and ds.dtypes[0] == "uint8" else None
        return {"path": path, "transform": ds.transform, "height": ds.height,
                "width": ds.width, "crs": ds.crs, "dtype": ds.dtypes[0],
                "nodata": ds.nodata, "colours": colours, "count": ds.count}


def write_vrt(paths: Sequence[Path], vrt: Path) -> Path:
    """One VRT over rasters of one CRS and band count (the module docstring); atomic."""
    infos = [_describe(p) for p in paths]
    res_x = min(i["transform"].a for i in infos)
    res_y = max(i["transform"].e for i in infos)  # negative: the finest is the largest
    west = min(i["transform"].c for i in infos)
    north = max(i["transform"].f for i in infos)
    east = max(i["transform"].c + i["width"] * i["transform"].a for i in infos)
    south = min(i["transform"].f + i["height"] * i["transform"].e for i in infos)
    dst = Affine(res_x, 0, west, 0, res_y, north)
    width, height = round((east - west) / res_x), round((south - north) / res_y)
    root = ET.Element("VRTDataset", rasterXSize=str(width), rasterYSize=str(height))
    if infos[0]["crs"] is not None:
        ET.SubElement(root, "SRS").text = infos[0]["crs"].to_wkt()
    ET.SubElement(root, "GeoTransform").text = ", ".join(repr(float(v))
                                                        for v in dst.to_gdal())
    ET.SubElement(ET.SubElement(root, "Metadata"), "MDI", key="written_by").text = MOSAIC_MARK
    counts = {i["count"] for i in infos}
    if len(counts) != 1:
        odd = next(i for i in infos if i["count"] != infos[0]["count"])
        raise InputError(f"'{odd['path']}' has {odd['count']} bands but '{infos[0]['path']}' "
                         f"has {infos[0]['count']}; a mosaic needs one band count")
    for k in range(1, infos[0]["count"] + 1):
        band = ET.SubElement(root, "VRTRasterBand", dataType=_gdal_type(infos[0]["dtype"]),
                             band=str(k))
        if infos[0]["nodata"] is not None:
            ET.SubElement(band, "NoDataValue").text = repr(float(infos[0]["nodata"]))
        if infos[0]["colours"]:
            ET.SubElement(band, "ColorInterp").text = "Palette"
            table = ET.SubElement(band, "ColorTable")
            for c in range(max(infos[0]["colours"]) + 1):
                r, g, b, a = infos[0]["colours"].get(c, (0, 0, 0, 0))
                ET.SubElement(table, "Entry", c1=str(r), c2=str(g), c3=str(b), c4=str(a))
        for info in infos:
            _source(band, k, info, dst, vrt.parent)
    tmp = vrt.with_name(f".{vrt.name}.{os.getpid()}.tmp")
    ET.ElementTree(root).write(tmp, encoding="utf-8", xml_declaration=False)
    os.replace(tmp, vrt)
    return vrt


def _source(band: ET.Element, k: int, info: dict[str, Any], dst: Affine, folder: Path
            ) -> None:
    src = ET.SubElement(band, "ComplexSource" if info["nodata"] is not None
                        else "SimpleSource")
    rel = os.path.relpath(info["path"], folder)
    ET.SubElement(src, "SourceFilename", relativeToVRT="1").text = rel
    ET.SubElement(src, "SourceBand").text = str(k)
    ET.SubElement(src, "SrcRect", xOff="0", yOff="0", xSize=str(info["width"]),
                  ySize=str(info["height"]))
    x, y, w, h = _window(info["transform"], dst, info["height"], info["width"])
    ET.SubElement(src, "DstRect", xOff=repr(x), yOff=repr(y), xSize=repr(w), ySize=repr(h))
    if info["nodata"] is not None:
        ET.SubElement(src, "NODATA").text = repr(float(info["nodata"]))


def masked_sources(path: Path) -> list[tuple[Path, int]]:
    """``(file, band)`` of each source of the VRT at ``path`` that GDAL reads through its mask.

    A source with ``<UseMaskBand>true</UseMaskBand>`` (``gdalbuildvrt`` writes it for pieces
    with an alpha band or a mask) is composited: where the piece's mask is 0, GDAL leaves
    the VRT's initial value (its no-data value, else 0) instead of the piece's samples.
    """
    root = ET.parse(path).getroot()
    found: list[tuple[Path, int]] = []
    for source in root.iter():
        use = source.find("UseMaskBand")
        name = source.find("SourceFilename")
        if use is None or name is None or (use.text or "").strip().lower() != "true":
            continue
        file = Path(name.text or "")
        if name.get("relativeToVRT") == "1":
            file = path.parent / file
        band = source.find("SourceBand")
        pair = (file, int((band.text if band is not None else None) or 1))
        if pair not in found:
            found.append(pair)
    return found


def written_mosaic(path: Path) -> bool:
    """Whether the VRT at ``path`` is a mosaic :func:`write_vrt` wrote (its mark)."""
    mark = ET.parse(path).getroot().find("Metadata/MDI[@key='written_by']")
    return mark is not None and mark.text == MOSAIC_MARK


def _rotated(transform: Affine) -> bool:
    return bool(transform.b or transform.d)


def _gdal_type(dtype: str) -> str:
    return {"uint8": "Byte", "uint16": "UInt16", "int16": "Int16", "uint32": "UInt32",
            "int32": "Int32", "float32": "Float32", "float64": "Float64"}[dtype]


def write_mosaics(paths: Sequence[Path], folder: Path, name: str = "mosaic") -> list[Path]:
    """One VRT per CRS of ``paths``: ``mosaic.vrt``, or ``mosaic_<epsg or n>.vrt`` for several.

    Rasters that are not north-up maps (no georeferencing: an identity transform, rows
    going down in y) are left out: placed by pixel rows they would all lie at one spot.
    So are rotated ones (logged): the mosaic is an extra, and the scene is predicted.
    """
    by_crs: dict[str, list[Path]] = {}
    keys: dict[str, str] = {}
    for p in paths:
        with open_dataset(p) as ds:
            if _rotated(ds.transform):  # a VRT places sources by offsets along the axes
                log.warning("%s left out of the mosaic: its geotransform is rotated (a VRT "
                            "mosaic places north-up rasters)", p)
                continue
        info = _describe(p)
        if info["transform"].e >= 0:
            continue
        wkt = info["crs"].to_wkt() if info["crs"] else ""
        if wkt not in keys:  # a name per CRS, given once and never shared
            key = str(info["crs"].to_epsg() or f"crs{len(keys) + 1}") if info["crs"] else "none"
            keys[wkt] = key if key not in keys.values() else f"{key}_{len(keys) + 1}"
        by_crs.setdefault(wkt, []).append(p)
    if len(by_crs) == 1:
        return [write_vrt(next(iter(by_crs.values())), folder / f"{name}.vrt")]
    return [write_vrt(group, folder / f"{name}_{keys[wkt]}.vrt")
            for wkt, group in by_crs.items()]
