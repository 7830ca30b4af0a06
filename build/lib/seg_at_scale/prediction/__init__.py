"""Prediction at scale: one tile engine, many processes, a resumable store, COG / zarr out."""

from seg_at_scale.prediction.options import PredictOptions
from seg_at_scale.prediction.raster import (
    PredictionStats,
    default_batch_size,
    output_kind,
    predict_raster,
)
from seg_at_scale.prediction.store import NODATA, PredictionStore

__all__ = ["PredictionStats", "PredictionStore", "PredictOptions", "NODATA",
           "default_batch_size", "output_kind", "predict_raster"]
