"""Whole-image metrics computed by streaming over label rasters (bounded memory)."""

from __future__ import annotations

import os

import numpy as np

from seg_at_scale.errors import InputError
from seg_at_scale.io.zarr_raster import open_raster
from seg_at_scale.tiling import Window

NODATA = 255  # the label a prediction carries where its image has no data

__all__ = ["confusion_matrix", "iou_from_confusion", "confusion_from_rasters"]


def confusion_matrix(pred: np.ndarray, truth: np.ndarray, num_classes: int,
                     ignore_index: int = 255) -> np.ndarray:
    """``[K, K]`` counts, rows = truth, columns = prediction.

    Skipped: pixels whose truth is ``ignore_index``, and pixels predicted as no-data
    (:data:`NODATA`, written where the image has no data), whatever ``ignore_index`` is.
    """
    keep = (truth != ignore_index) & (pred != ignore_index) & (pred != NODATA)
    t, p = truth[keep].astype(np.int64), pred[keep].astype(np.int64)
    return np.bincount(t * num_classes + p, minlength=num_classes**2).reshape(
        num_classes, num_classes)


def iou_from_confusion(cm: np.ndarray) -> np.ndarray:
    """Per-class IoU (NaN for a class absent from truth and prediction)."""
    tp = np.diag(cm).astype(np.float64)
    denom = cm.sum(0) + cm.sum(1) - tp
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denom > 0, tp / denom, np.nan)


def confusion_from_rasters(pred: str | os.PathLike[str], truth: str | os.PathLike[str],
                           num_classes: int, ignore_index: int = 255,
                           band_rows: int = 1024) -> np.ndarray:
    """Confusion matrix of two single-band label rasters of the same size, by row bands."""
    with open_raster(pred) as p, open_raster(truth) as t:
        if (p.height, p.width) != (t.height, t.width):
            raise InputError(f"prediction '{p.path}' is {p.height}x{p.width} but mask "
                             f"'{t.path}' is {t.height}x{t.width}; score against the mask of "
                             "the predicted image")
        cm = np.zeros((num_classes, num_classes), np.int64)
        for r0 in range(0, p.height, band_rows):
            w = Window(r0, 0, min(band_rows, p.height - r0), p.width)
            band = t.read(w)[0]
            labels = band[band != ignore_index]
            if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
                bad = labels.max() if labels.max() >= num_classes else labels.min()
                raise InputError(f"mask '{t.path}' has label {bad}, which is neither a class "
                                 f"0..{num_classes - 1} nor ignore_index={ignore_index}: score "
                                 "against a mask of this model's classes")
            cm += confusion_matrix(p.read(w)[0], band, num_classes, ignore_index)
    return cm
