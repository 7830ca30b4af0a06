"""Prediction at scale: one tile engine, many processes, a resumable store, COG / zarr out.

The names below are imported on first use (PEP 562), so that the entry point can take its
output lock (:mod:`seg_at_scale.prediction.lock`) before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from seg_at_scale.prediction.options import PredictOptions, default_batch_size
    from seg_at_scale.prediction.outputs import output_kind
    from seg_at_scale.prediction.raster import PredictionStats, predict_raster
    from seg_at_scale.prediction.store import NODATA, PredictionStore

_WHERE = {"PredictOptions": "options", "PredictionStats": "raster", "default_batch_size": "options",
          "output_kind": "outputs", "predict_raster": "raster", "NODATA": "store",
          "PredictionStore": "store"}

__all__ = ["PredictionStats", "PredictionStore", "PredictOptions", "NODATA",
           "default_batch_size", "output_kind", "predict_raster"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'seg_at_scale.prediction' has no attribute {name!r}")
    return getattr(importlib.import_module(f"seg_at_scale.prediction.{_WHERE[name]}"), name)
