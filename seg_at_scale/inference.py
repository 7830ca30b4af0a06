"""Whole-raster prediction (kept for old imports): see :mod:`seg_at_scale.prediction`."""

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.io.valid import read_valid
from seg_at_scale.prediction import NODATA as IGNORE_INDEX
from seg_at_scale.prediction import PredictionStats, predict_raster

__all__ = ["Normalizer", "PredictionStats", "predict_raster", "read_valid", "IGNORE_INDEX"]
