"""One scene predicted with a trained model: checks, tiles, score, preview.

>>> from seg_at_scale.models.loading import load_trained  # doctest: +SKIP
>>> trained = load_trained(run="runs/same_unet_small/2026-11-25_10-00-00")  # doctest: +SKIP
>>> predict_scene(trained, Path("scene.tif"), Path("scene_mask.tif"),
...               PredictOptions(fast=True))["prediction"]  # doctest: +SKIP
'scene_mask.tif'
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from seg_at_scale.catalog.items import item_path, stac_item, write_item
from seg_at_scale.errors import OutputExistsError
from seg_at_scale.io import RasterReader, read_overview, write_preview_png
from seg_at_scale.io.writer import temporary_path, write_atomic
from seg_at_scale.io.zarr_raster import open_raster
from seg_at_scale.metrics import confusion_from_rasters, iou_from_confusion
from seg_at_scale.models.trained import TrainedModel
from seg_at_scale.parallel.launch import rank_world
from seg_at_scale.prediction.checks import (
    check_scene,
    companion_is_ours,
    not_ours,
    preview_path,
    probabilities_path,
    same_path,
)
from seg_at_scale.prediction.layout_choice import with_layout
from seg_at_scale.prediction.lock import scene_lock
from seg_at_scale.prediction.options import PredictOptions
from seg_at_scale.prediction.provenance import (
    file_sha256,
    finished,
    mark_item,
    mark_png,
    owner_of,
    recorded_fingerprint,
    vector_record,
    written_by,
)
from seg_at_scale.prediction.raster import PredictionStats, on_rank0, predict_raster
from seg_at_scale.vectors import write_vectors

__all__ = ["predict_scene", "companions", "vector_record"]

log = logging.getLogger(__name__)


def predict_scene(trained: TrainedModel, image: str | os.PathLike[str],
                  output: str | os.PathLike[str], options: PredictOptions | None = None,
                  *, mask: str | os.PathLike[str] | None = None,
                  model_files: Mapping[str, Path] | None = None, checked: bool = False,
                  vector: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Predict one image file whole; optionally score it against ``mask``; draw a preview.

    Every check runs before the model does (:func:`~seg_at_scale.prediction.checks.check_scene`)
    unless ``checked`` says the caller ran it (the launcher of a multi-process run). Rank 0
    holds the output's lock (:func:`~seg_at_scale.prediction.lock.scene_lock`) from before
    the first tile until the last companion is written.

    Args:
        trained: the model (its ``model`` already on the device to run on).
        image: input raster.
        output: ``.tif`` (COG) or ``.zarr``.
        options: the prediction's options (default :class:`PredictOptions`).
        mask: ground truth to score against (per-class IoU, mIoU, pixel accuracy).
        model_files: the model's files (no output may be one of them).
        checked: the scene's checks already ran.
        vector: also write the labels' polygons there (``.gpkg``, ``.parquet``, ``.fgb``).

    Returns:
        The result as plain data (what ``seg-predict`` prints).
    """
    if options is not None and not isinstance(options, PredictOptions):
        raise TypeError(f"predict_scene: options is a {type(options).__name__}; give a "
                        "PredictOptions (PredictOptions(**values) from a dict) or None")
    image, output = Path(image), Path(output)
    options = options or PredictOptions()
    model = trained.model.eval()
    lock = scene_lock(output) if rank_world()[0] == 0 else contextlib.nullcontext()
    with lock:
        return _predict_scene(trained, model, image, output, options,
                              mask=None if mask is None else Path(mask),
                              model_files=model_files, checked=checked,
                              vector=None if vector is None else Path(vector))


def _predict_scene(trained: TrainedModel, model: torch.nn.Module, image: Path, output: Path,
                   options: PredictOptions, *, mask: Path | None,
                   model_files: Mapping[str, Path] | None, checked: bool,
                   vector: Path | None) -> dict[str, Any]:
    if not checked:
        cuda = next(model.parameters()).device.type == "cuda"
        ranks = rank_world()[1]
        check_scene(image, output, options, card=trained.card, source=trained.source,
                    model_files=model_files or {}, mask=mask, ranks=ranks, cuda=cuda,
                    vector=vector)
    options = with_layout(options, model, trained.bands, decide=on_rank0)
    if options.channels_last:
        model = model.to(memory_format=torch.channels_last)
    exact = trained.card.exact
    if not exact:
        log.warning("%s was trained with tiling.exact=false: '%s' is approximate (overlapping "
                    "tiles, halo %d), not the whole-image forward", trained.source, output,
                    trained.footprint.halo)
    stats = predict_raster(model, image, output, options, fp=trained.footprint,
                           normalizer=trained.normalizer, class_names=trained.class_names,
                           exact=exact)
    out = _result(image, output, stats)
    out["exact"] = exact
    if rank_world()[0] != 0:
        return out  # rank 0 scores and draws
    if mask is not None:
        cm = confusion_from_rasters(output, mask, trained.num_classes, trained.ignore_index)
        iou = iou_from_confusion(cm)
        out["iou"] = [None if np.isnan(v) else round(float(v), 4) for v in iou]
        out["miou"] = round(float(np.nanmean(iou)), 4)
        out["pixel_accuracy"] = round(float(np.trace(cm) / max(cm.sum(), 1)), 4)
    out.update(companions(trained, image, output, options, vector, stats))
    return out


def companions(trained: TrainedModel, image: Path, output: Path, options: PredictOptions,
               vector: Path | None, stats: PredictionStats) -> dict[str, str]:
    """Rank 0: the preview, the polygons and the STAC Item of a finished output.

    Written when the output was computed now; when this same prediction had finished it
    before (``stats.reused``), the preview only if missing (a run killed while writing it),
    the polygons if missing or made with other vector options (:func:`_vector_stale`), and
    the STAC Item if missing, if its assets are not this run's companions, or if the
    polygons were written again. Existing ones were checked before any work
    (:func:`check_scene`), and are again before each is written: only a file this same
    prediction wrote (its record: :func:`~.finished.written_by`) is replaced without
    ``overwrite``. Each written file records the prediction and its content hash.
    """
    made: dict[str, str] = {}
    png = preview_path(output)
    done = finished_digest(output)
    mine = owner_of(output)  # what this prediction's companions record as their writer
    if options.overwrite and not stats.reused:
        _drop_replaced(output, options, vector, mine)
    if options.preview:
        if not (stats.reused and png.exists()):
            _may_write("preview", png, output, options)
            with RasterReader(image) as img, open_raster(output) as pred:
                tmp = temporary_path(png, "preview")
                try:
                    write_preview_png(tmp, read_overview(img, 1024),
                                      read_overview(pred, 1024)[0], trained.num_classes,
                                      overwrite=True)
                    marked = mark_png(tmp.read_bytes(), mine)
                    write_atomic(png, lambda path: path.write_bytes(marked))
                finally:
                    tmp.unlink(missing_ok=True)
        made["preview"] = str(png)
    probs = _probabilities_source(output, options)
    rewritten = not stats.reused
    if vector is not None:
        made_with = _vector_options(output, options, probs)
        if not stats.reused or _vector_stale(vector, made_with):
            _may_write("vector", vector, output, options)
            vector.parent.mkdir(parents=True, exist_ok=True)
            record = vector_record(vector)  # first: the file about to be written is ours
            pending = json.dumps({**made_with, "pending": True})
            write_atomic(record, lambda path: path.write_text(pending))
            write_vectors(output, vector, class_names=trained.class_names,
                          connectivity=options.vector_connectivity,
                          min_area=options.vector_min_area, simplify=options.vector_simplify,
                          classes=options.vector_classes, probabilities=probs,
                          overwrite=True, key="vector")
            written = {**made_with, "sha256": file_sha256(vector)}
            write_atomic(record, lambda path: path.write_text(json.dumps(written)))
            rewritten = True  # new polygons: the Item's checksum of them changes
        made["vector"] = str(vector)
    if options.stac:
        item = item_path(output)
        tif_probs = probs if probs is not None and probs.suffix != ".zarr" else None
        assets = {"labels", *(["probabilities"] if tif_probs else []),
                  *(["vectors"] if vector is not None else [])}
        have = _assets(item)
        if rewritten or have is None or set(have) != assets:
            _may_write("stac", item, output, options)
            weights = (recorded_fingerprint(output) or {}).get("model")
            model = {"source": trained.source, "family": trained.card.family,
                     "weights": f"sha256:{weights}" if weights else None, "prediction": done}
            doc = stac_item(output, source_image=image, class_names=trained.class_names,
                            colours=trained.card.colours, model=model,
                            probabilities=tif_probs, vectors=vector)
            tmp = temporary_path(output, "item")  # its Item: beside it, renamed when marked
            try:
                unmarked = write_item(doc, tmp)
                mark_item(unmarked, mine)
                os.replace(unmarked, item)
            finally:
                item_path(tmp).unlink(missing_ok=True)
        made["stac"] = str(item)
    return made


def _drop_replaced(output: Path, options: PredictOptions, vector: Path | None,
                   done: str | None) -> None:
    """Remove what a prediction replaced by ``overwrite=true`` had beside it.

    Its companions that this prediction does not write again describe the replaced
    labels: the preview, the STAC Item and a ``.tif`` output's probabilities at their
    names beside the output, and the polygons the replaced Item names. Only files a prediction wrote
    and nobody changed since (:func:`~.provenance.written_by`): a file of the user's at
    one of those names stays.
    """
    item = item_path(output)
    stale = [(k, p) for k, p, again in (
        ("preview", preview_path(output), options.preview),
        ("stac", item, options.stac),
        ("probabilities", probabilities_path(output),
         options.probabilities is not None or output.suffix.lower() == ".zarr"),
    ) if not again]
    polygons = _item_asset(item, "vectors")
    if polygons is not None and (vector is None or not same_path(polygons, vector)):
        stale.append(("vector", polygons))
    for key, path in stale:
        made_by = written_by(key, path) if path.exists() else None
        if made_by is not None and made_by != done:
            path.unlink()
            if key == "vector":
                vector_record(path).unlink(missing_ok=True)
            log.info("removed %s '%s': it was the replaced prediction's", key, path)


def _item_asset(item: Path, key: str) -> Path | None:
    """The local file an existing STAC Item's asset ``key`` names (None: none)."""
    href = ((_assets(item) or {}).get(key) or {}).get("href")
    if not isinstance(href, str) or "://" in href:
        return None
    return (item.parent / href).resolve()


def _may_write(key: str, path: Path, output: Path, options: PredictOptions) -> None:
    """Refuse to replace a companion this prediction did not write, unless ``overwrite``.

    Checked before any work too (:func:`~.checks.check_outputs`); here again, just before
    the write, for a file that appeared since.
    """
    if not options.overwrite and not companion_is_ours(key, path, output):
        raise OutputExistsError(not_ours(key, path, output))


def _assets(item: Path) -> dict[str, Any] | None:
    """The assets of an existing STAC Item by key (None: missing or unreadable)."""
    try:
        assets = json.loads(item.read_text())["assets"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return assets if isinstance(assets, dict) else None


def _vector_options(output: Path, options: PredictOptions,
                    probs: Path | None) -> dict[str, Any]:
    """What decides a vector file's polygons, beside the labels they are drawn from."""
    return {"output": owner_of(output), "connectivity": options.vector_connectivity,
            "min_area": options.vector_min_area, "simplify": options.vector_simplify,
            "classes": None if options.vector_classes is None else list(options.vector_classes),
            "probabilities": None if probs is None else str(probs)}


def _vector_stale(vector: Path, made_with: dict[str, Any]) -> bool:
    """Whether a reused output's vector file is missing or was made with other options."""
    try:
        record = json.loads(vector_record(vector).read_text())
    except (OSError, ValueError):
        return True
    if not isinstance(record, dict) or record.get("pending") or not vector.exists():
        return True
    return {k: v for k, v in record.items() if k != "sha256"} != made_with


def _probabilities_source(output: Path, options: PredictOptions) -> Path | None:
    """Where the softmax of a finished output is: its ``_probabilities.tif``, or the store."""
    if not options.probabilities:
        return None
    return output if output.suffix.lower() == ".zarr" else probabilities_path(output)


def finished_digest(output: Path) -> str | None:
    state = finished(output)
    return state[0] if state else None


def _result(image: Path, output: Path, stats: PredictionStats) -> dict[str, Any]:
    return {"image": str(image), "prediction": str(output), "tiles": stats.tiles,
            "efficiency": round(stats.efficiency, 4), "processes": stats.processes,
            "tiles_computed": stats.tiles_computed, "tiles_resumed": stats.tiles_resumed,
            "seconds": round(stats.total_s, 2), "mpix_per_s": round(stats.mpix_per_s, 3),
            "read_s": round(stats.read_s, 2), "model_s": round(stats.model_s, 2),
            "write_s": round(stats.write_s, 2), "finalize_s": round(stats.finalize_s, 2),
            "class_pixels": stats.class_pixels}
