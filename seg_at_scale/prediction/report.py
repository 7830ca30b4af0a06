"""An archive's report: per-scene scores, ``summary.csv`` / ``.json``, mosaics, STAC items.

Written by rank 0 after every scene is finished, skipped or failed, atomically (a
temporary file, then a rename), so a killed run never leaves half a summary:

* ``summary.csv`` and ``summary.json``: per scene its status (``done``, ``reused``,
  ``skipped``, ``failed``) and reason, tiles computed and resumed, seconds (summed over
  ranks), Mpix/s, class histogram, and mIoU / per-class IoU where ``masks=`` had truth;
* ``mosaic.vrt`` (one per CRS) over the ``.tif`` outputs: the archive as one layer;
* ``items.json``: a STAC ItemCollection of the scenes' Items (``stac=true``).

A file under one of those names that no archive wrote (the user's) is refused before any
tile (:func:`check_report_files`), unless ``overwrite=true``; a rerun replaces its own.
"""

from __future__ import annotations

import csv
import io
import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from seg_at_scale.errors import OutputExistsError
from seg_at_scale.metrics import confusion_from_rasters, iou_from_confusion
from seg_at_scale.prediction.archive import ArchiveScene, SceneRecord

__all__ = ["score", "write_report", "check_report_files", "SUMMARY_COLUMNS"]

SUMMARY_COLUMNS = ("stem", "status", "reason", "tiles", "tiles_computed", "tiles_resumed",
                   "seconds", "megapixels", "mpix_per_s", "miou", "class_pixels", "iou",
                   "finalized_by", "tiles_by_rank", "image", "output")


def score(records: Sequence[SceneRecord], scenes: Sequence[ArchiveScene], num_classes: int,
          ignore_index: int) -> dict[str, Any] | None:
    """MIoU and per-class IoU of every scored scene (in place), and the archive's.

    A scored scene is a finished one with a mask. The archive's score is over the pixels of
    all of them at once (their confusion matrices summed, as a test set is scored), not the
    mean of the scenes' mIoU, which weighs a small scene as much as a large one; None when
    no scene was scored.
    """
    by_stem = {s.stem: s for s in scenes}
    total = np.zeros((num_classes, num_classes), np.int64)
    scored = 0
    for rec in records:
        mask = by_stem[rec.stem].mask if rec.stem in by_stem else None
        if mask is None or rec.status not in ("done", "reused"):
            continue
        cm = confusion_from_rasters(Path(rec.output), mask, num_classes, ignore_index)
        rec.iou, rec.miou = _ious(cm)
        total += cm
        scored += 1
    if not scored:
        return None
    iou, miou = _ious(total)
    return {"scenes": scored, "miou": miou, "iou": iou}


def _ious(cm: np.ndarray) -> tuple[list[float | None], float]:
    """Per-class IoU (None: a class absent from truth and labels) and their mean."""
    iou = iou_from_confusion(cm)
    return [None if np.isnan(v) else round(float(v), 4) for v in iou], \
        round(float(np.nanmean(iou)), 4)


def _row(rec: SceneRecord) -> dict[str, Any]:
    row = asdict(rec)
    row["mpix_per_s"] = round(rec.megapixels / rec.seconds, 3) if rec.seconds else None
    row["seconds"] = round(rec.seconds, 2)
    row["megapixels"] = round(rec.megapixels, 3)
    return row


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def merge_vectors(records: Sequence[SceneRecord], scenes: Sequence[ArchiveScene],
                  output_dir: Path) -> Path | None:
    """Every finished scene's polygons in one file, ``vectors.<ext>``, with a ``scene`` column.

    Scenes in another CRS than the first are reprojected to it (GeoPandas), their ``area``
    measured again in its units (scenes with a CRS and without one are refused before the
    work: :func:`~.archive.check_merge`). GeoPackage and
    FlatGeobuf are appended scene by scene; GeoParquet is written once (all polygons in
    memory). Written under a temporary name and renamed when complete.
    """
    import geopandas as gpd
    import pyogrio

    done = {r.stem for r in records if r.status in ("done", "reused")}
    pieces = [s.vector for s in scenes if s.stem in done and s.vector is not None
              and s.vector.exists()]
    if not pieces:
        return None
    out = output_dir / f"vectors{pieces[0].suffix}"
    tmp = output_dir / f".vectors.{os.getpid()}.tmp{pieces[0].suffix}"
    tmp.unlink(missing_ok=True)
    crs, frames = None, []
    parquet = out.suffix == ".parquet"  # GDAL here has no Parquet driver: one write
    for k, piece in enumerate(pieces):
        frame = gpd.read_file(piece) if not parquet else gpd.read_parquet(piece)
        crs = crs or frame.crs
        if crs is not None and frame.crs is not None and frame.crs != crs:
            frame = frame.to_crs(crs)
            frame["area"] = frame.geometry.area  # in the merged layer's units
        frame.insert(0, "scene", piece.stem)
        if parquet:
            frames.append(frame)
        else:  # streamed: one scene in memory at a time
            with warnings.catch_warnings():  # scenes without a CRS: pixel coordinates
                warnings.filterwarnings("ignore", "'crs' was not provided", UserWarning)
                pyogrio.write_dataframe(frame, tmp, layer="vectors", append=k > 0)
    if parquet:
        import pandas as pd

        gpd.GeoDataFrame(pd.concat(frames, ignore_index=True), crs=crs).to_parquet(tmp)
    os.replace(tmp, out)
    return out


def check_report_files(output_dir: Path, *, mosaics: bool, stac: bool,
                       merged: str | None, overwrite: bool) -> None:
    """Refuse a file the report would replace that no archive wrote, before any tile.

    ``mosaics``: the outputs are ``.tif`` (``mosaic*.vrt``); ``merged``: the suffix of the
    merged polygons (``vector_merge``), or None. Each kind of file is told by its content:
    the summary's columns and keys, the scenes' Items, the mosaic's mark, the merged layer.
    """
    if overwrite or not output_dir.is_dir():
        return
    names = ["summary.csv", "summary.json", *(["items.json"] if stac else []),
             *([f"vectors{merged}"] if merged else [])]
    paths = [output_dir / n for n in names]
    if mosaics:
        paths += sorted(output_dir.glob("mosaic*.vrt"))
    for path in paths:
        if path.exists() and not _written_by_an_archive(path):
            raise OutputExistsError(
                f"output_dir '{output_dir}' holds {path.name}, which the archive's report "
                "writes and no archive prediction wrote; pass overwrite=true to replace it, "
                "or choose another output_dir")


def _written_by_an_archive(path: Path) -> bool:
    """Whether ``path`` is a report file as :func:`write_report` (or the merge) writes it."""
    from seg_at_scale.prediction.provenance import WRITTEN_KEY

    if not path.is_file():
        return False
    try:
        if path.suffix == ".csv":
            with path.open(newline="") as f:
                return next(csv.reader(f), None) == list(SUMMARY_COLUMNS)
        if path.name == "summary.json":
            doc = json.loads(path.read_text())
            return isinstance(doc, dict) and {"scenes", "summary", *_COUNTS} <= doc.keys()
        if path.name == "items.json":
            doc = json.loads(path.read_text())
            return doc.get("type") == "FeatureCollection" and all(
                WRITTEN_KEY in f.get("properties", {}) for f in doc.get("features", []))
        if path.suffix == ".vrt":
            from seg_at_scale.io.vrt import written_mosaic

            return written_mosaic(path)
        import pyogrio

        return "scene" in pyogrio.read_info(path, layer="vectors")["fields"]
    except Exception:  # noqa: BLE001 - unreadable as ours: the user's
        return False


_COUNTS = ("done", "reused", "skipped", "failed")


def write_report(records: Sequence[SceneRecord], output_dir: Path, *,
                 stac: bool, scores: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the summary, the mosaics and the ItemCollection; what was written.

    ``scores``: the archive's own (:func:`score`), into ``summary.json`` as ``score``.
    """
    rows = [_row(r) for r in records]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=SUMMARY_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({**row, **{k: json.dumps(row[k])
                                   for k in ("class_pixels", "iou", "tiles_by_rank")}})
    _atomic(output_dir / "summary.csv", buf.getvalue())
    counts = {k: sum(r.status == k for r in records) for k in _COUNTS}
    doc: dict[str, Any] = {"scenes": len(records), **counts,
                           **({"score": scores} if scores is not None else {}), "summary": rows}
    finished = [Path(r.output) for r in records if r.status in ("done", "reused")]
    tifs = [p for p in finished if p.suffix.lower() in (".tif", ".tiff")]
    from seg_at_scale.io.vrt import write_mosaics

    mosaics = write_mosaics(tifs, output_dir) if tifs else []
    if tifs:
        doc["mosaics"] = [str(p) for p in mosaics]
    for old in sorted(output_dir.glob("mosaic*.vrt")):  # another set of CRSs before
        if old not in mosaics and _written_by_an_archive(old):  # its mark: never the user's
            old.unlink()
    if stac and finished:
        import pystac

        from seg_at_scale.catalog import item_path, write_item_collection

        items = [pystac.Item.from_file(str(item_path(p))) for p in finished
                 if item_path(p).exists()]
        doc["items"] = str(write_item_collection(items, output_dir / "items.json"))
    _atomic(output_dir / "summary.json", json.dumps(doc, indent=2) + "\n")
    return doc
