"""A STAC Item beside each output raster, and an ItemCollection for an archive.

>>> item = stac_item("out/scene_mask.tif", source_image="scenes/scene.tif",  # doctest: +SKIP
...                  class_names=["background", "vegetation", "water", "road", "building"],
...                  model={"run": "runs/unet", "fingerprint": "sha256:..."})
>>> write_item(item, "out/scene_mask.tif")  # doctest: +SKIP
PosixPath('out/scene_mask.stac.json')

The Item says where the raster lies (geometry and bbox in WGS 84, reprojected locally by
rasterio / PROJ, no network), how it is gridded (``proj``: code or WKT2, shape, transform),
what its band holds (``raster``: uint8, nodata 255; ``classification``: value, name and
colour hint of every class), what the file is (``file``: size, and a sha2-256 multihash for
a single file), which image it was made from (a ``derived_from`` link) and by which model
(``seg_at_scale:model``, the dict the caller passes). Its datetime is the input TIFF's
DateTime tag when it has one, else the time the Item was made:
``seg_at_scale:datetime_source`` says which.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pystac
import tifffile
from pystac.extensions.classification import Classification, ClassificationExtension
from pystac.extensions.file import FileExtension
from pystac.extensions.projection import ProjectionExtension
from pystac.extensions.raster import DataType, RasterBand, RasterExtension
from pystac.utils import make_relative_href

from seg_at_scale.errors import InputError
from seg_at_scale.io.preview import default_palette
from seg_at_scale.io.raster import is_tiff
from seg_at_scale.io.writer import temporary_path
from seg_at_scale.vectors.sources import NODATA, georeference, open_labels

__all__ = [
    "ITEM_SUFFIX",
    "item_collection",
    "item_path",
    "multihash_sha256",
    "stac_item",
    "write_item",
    "write_item_collection",
]

#: ``scene_mask.tif`` -> ``scene_mask.stac.json``: beside the output, never mistaken for it.
ITEM_SUFFIX = ".stac.json"
_MEDIA = {".tif": pystac.MediaType.COG, ".tiff": pystac.MediaType.COG,
          ".zarr": pystac.MediaType.ZARR, ".gpkg": pystac.MediaType.GEOPACKAGE,
          ".parquet": pystac.MediaType.PARQUET, ".fgb": pystac.MediaType.FLATGEOBUF}


def multihash_sha256(path: str | os.PathLike[str]) -> str:
    """The file's sha2-256 as a hex multihash (``1220`` + digest), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return "1220" + digest.hexdigest()


def item_path(output: str | os.PathLike[str]) -> Path:
    """Where the Item of ``output`` is written: ``<stem>.stac.json`` beside it."""
    out = Path(output)
    return out.with_name(out.stem + ITEM_SUFFIX)


def stac_item(output: str | os.PathLike[str], *, source_image: str | os.PathLike[str],
              class_names: Sequence[str], colours: Sequence[Sequence[int] | str] | None = None,
              model: Mapping[str, Any] | None = None,
              probabilities: str | os.PathLike[str] | None = None,
              vectors: str | os.PathLike[str] | None = None) -> pystac.Item:
    """Describe an output label raster (COG ``.tif`` or ``.zarr``) as a STAC Item.

    Args:
        output: the label raster; the Item's id is its stem.
        source_image: the image it was predicted from (``derived_from`` link, datetime).
        class_names: name of each class id.
        colours: colour hint per class, ``(r, g, b)`` or hex; default: the preview's.
        model: what made it, e.g. ``{"run": ..., "fingerprint": ...}``; stored as given.
        probabilities: the ``*_probabilities.tif`` to add as an asset.
        vectors: the polygons (``.gpkg`` / ``.parquet`` / ``.fgb``) to add as an asset.

    Raises:
        InputError: ``output`` or ``source_image`` cannot be read.
    """
    out, source = Path(output), Path(source_image)
    if not source.exists():
        raise InputError(f"source_image '{source}' does not exist; pass the image the "
                         "output was predicted from")
    transform, crs = georeference(out)
    labels = open_labels(out)
    shape = [labels.height, labels.width]
    labels.close()
    when, origin = _datetime(source)
    geometry, bbox = _footprint(transform, crs, shape)
    item = pystac.Item(out.stem, geometry, bbox, when, {
        "seg_at_scale:datetime_source": origin,
        "seg_at_scale:model": dict(model or {}),
        "seg_at_scale:class_names": list(class_names)})
    proj = ProjectionExtension.ext(item, add_if_missing=True)
    epsg = crs.to_epsg() if crs else None
    proj.apply(code=f"EPSG:{epsg}" if epsg else None, shape=shape, transform=list(transform)[:6],
               wkt2=crs.to_wkt(version="WKT2_2019") if crs and not epsg else None)
    _describe_labels(_add_asset(item, "labels", out, "class labels"), class_names, colours)
    for key, path in (("probabilities", probabilities), ("vectors", vectors)):
        if path is not None:
            _add_asset(item, key, Path(path), key)
    item.add_link(pystac.Link("derived_from", str(source.resolve()), _media_type(source),
                              f"source image {source.name}"))
    item.set_self_href(str(item_path(out).resolve()))
    return item


def _add_asset(item: pystac.Item, key: str, path: Path, title: str) -> pystac.Asset:
    """A data asset with its media type, ``file:size`` and (for a file) ``file:checksum``."""
    if not path.exists():
        raise InputError(f"'{path}' does not exist; write the {title} before its STAC Item")
    asset = pystac.Asset(str(path.resolve()), title=title, roles=["data"],
                         media_type=_MEDIA.get(path.suffix.lower()))
    item.add_asset(key, asset)
    ext = FileExtension.ext(asset, add_if_missing=True)
    if path.is_dir():  # a zarr store: many files, no single checksum
        ext.size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    else:
        ext.apply(size=path.stat().st_size, checksum=multihash_sha256(path))
    return asset


def _describe_labels(asset: pystac.Asset, names: Sequence[str],
                     colours: Sequence[Sequence[int] | str] | None) -> None:
    RasterExtension.ext(asset, add_if_missing=True).bands = [
        RasterBand.create(nodata=NODATA, data_type=DataType.UINT8)]
    hints = [c if isinstance(c, str) else "{:02X}{:02X}{:02X}".format(*c[:3])
             for c in (colours or default_palette(len(names)))]
    if len(hints) < len(names):
        raise InputError(f"colours lists {len(hints)} colours for {len(names)} classes; give "
                         "one per class or none")
    ClassificationExtension.ext(asset, add_if_missing=True).classes = [
        Classification.create(value=k, name=_stac_name(n), description=n,
                              color_hint=hints[k].lstrip("#").upper())
        for k, n in enumerate(names)] + [
        Classification.create(value=NODATA, name="no_data", nodata=True)]


def _stac_name(name: str) -> str:
    """Classification names are ``^[0-9A-Za-z-_]+$``: other characters become ``_``."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name) or "_"


def _media_type(source: Path) -> str | None:
    """The source image's media type: a TIFF's, else by GDAL format (None: not known)."""
    if is_tiff(source):
        return str(pystac.MediaType.GEOTIFF)
    return {".vrt": str(pystac.MediaType.XML), ".jp2": str(pystac.MediaType.JPEG2000)}.get(
        source.suffix.lower())


def _datetime(source: Path) -> tuple[dt.datetime, str]:
    """The input TIFF's DateTime tag (taken as UTC), else now; and which of the two."""
    try:
        with tifffile.TiffFile(source) as tif:
            tag = tif.pages.first.tags.get(306)  # DateTime, "YYYY:MM:DD HH:MM:SS"
            value = str(tag.value).strip("\x00 ") if tag is not None else ""
        when = dt.datetime.strptime(value, "%Y:%m:%d %H:%M:%S").replace(tzinfo=dt.timezone.utc)
        return when, f"DateTime tag of {source.name}"
    except (OSError, ValueError, tifffile.TiffFileError):
        return dt.datetime.now(dt.timezone.utc).replace(microsecond=0), "time the Item was made"


def _footprint(transform: Any, crs: Any, shape: list[int]
               ) -> tuple[dict[str, Any] | None, list[float] | None]:
    """The raster's outline and bbox in WGS 84 (None without a CRS)."""
    if crs is None:
        return None, None
    import shapely
    from rasterio.warp import transform_geom

    h, w = shape
    outline = shapely.Polygon([transform @ xy for xy in ((0, 0), (w, 0), (w, h), (0, h))])
    # 8 points per side, so that the edges follow the curves they map to in WGS 84
    side = max(outline.length / 4, 1e-9)
    dense = shapely.segmentize(outline, side / 8)
    geometry = transform_geom(crs, "EPSG:4326", shapely.geometry.mapping(dense),
                              antimeridian_cutting=True)
    bbox = shapely.bounds(shapely.geometry.shape(geometry)).tolist()
    return dict(geometry), [float(v) for v in bbox]


def write_item(item: pystac.Item, output: str | os.PathLike[str] | None = None) -> Path:
    """Write ``item`` as ``<output stem>.stac.json`` beside ``output`` (temp file + rename).

    Asset hrefs are written relative to the Item (the folder moves as a whole); the
    ``derived_from`` link keeps the source image's absolute path (it lies elsewhere).

    Args:
        item: from :func:`stac_item`.
        output: the raster it describes (default: the Item's own self href).

    Returns:
        The JSON file written.
    """
    path = (item_path(output) if output is not None
            else Path(item.get_self_href() or f"{item.id}{ITEM_SUFFIX}")).resolve()
    item.set_self_href(str(path))
    return _write_json(_relative_dict(item, path), path)


def item_collection(items: Iterable[pystac.Item]) -> pystac.ItemCollection:
    """The Items of an archive as one ItemCollection (a GeoJSON FeatureCollection)."""
    return pystac.ItemCollection(list(items), clone_items=False)


def write_item_collection(items: pystac.ItemCollection | Iterable[pystac.Item],
                          path: str | os.PathLike[str]) -> Path:
    """Write an ItemCollection (e.g. ``items.json`` at the archive's root), atomically.

    Asset hrefs are made relative to ``path``, so
    :func:`~seg_at_scale.catalog.inputs.image_hrefs` and STAC tools resolve them wherever
    the archive is copied.
    """
    out = Path(path).resolve()
    features = [_relative_dict(item, out) for item in items]
    return _write_json({"type": "FeatureCollection", "features": features}, out)


def _relative_dict(item: pystac.Item, json_path: Path) -> dict[str, Any]:
    """The Item as a dict whose asset hrefs are relative to ``json_path``."""
    doc = item.to_dict(include_self_link=False, transform_hrefs=False)
    for key, asset in item.assets.items():
        href = asset.get_absolute_href() or asset.href
        doc["assets"][key]["href"] = make_relative_href(href, str(json_path))
    return doc


def _write_json(doc: dict[str, Any], path: Path) -> Path:
    tmp = temporary_path(path)
    try:
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path

