"""Training with pretrained encoders: which footprint, and whose normalisation.

Entry-point code (it reads the ``DictConfig``): :func:`run_footprint` honours
``tiling.exact``; :func:`use_weights_normalization` gives the data the normalisation the
weights were trained with (``finetune.normalization=weights``), or reports the difference.
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig
from torch import nn

from seg_at_scale.cli.runs import RunFolder
from seg_at_scale.errors import ConfigError
from seg_at_scale.models.trained import tiling_footprint
from seg_at_scale.tiling import Footprint

__all__ = ["run_footprint", "use_weights_normalization"]

log = logging.getLogger(__name__)


def run_footprint(model: nn.Module, tiling: DictConfig) -> Footprint:
    """The exact footprint, or with ``tiling.exact=false`` the model's approximate one."""
    return tiling_footprint(model, tiling)


def _per_band(values: Any, bands: int) -> list[float] | None:
    if isinstance(values, str):
        return None  # 'auto'
    v = [float(x) for x in values]
    return v * bands if len(v) == 1 else v


def use_weights_normalization(cfg: DictConfig, model: nn.Module, run: RunFolder,
                              computed: dict[str, Any]) -> None:
    """Apply ``finetune.normalization`` to the data group (before anything reads it).

    ``weights`` fills ``data.mean/std`` (and ``scale`` when the weights state one) from the
    model's recorded normalisation, band by band (bands the weights do not cover keep the
    data's values); ``data`` keeps them and reports a difference. Recorded in the run's
    computed values either way.
    """
    record = getattr(model, "input_normalization", None)
    norm = record() if callable(record) else None
    if norm is None:
        return
    policy = str((cfg.get("finetune") or {}).get("normalization", "weights"))
    if policy not in ("weights", "data"):
        raise ConfigError(f"finetune.normalization={policy!r}: use 'weights' (the data takes "
                          "the pretrained weights' mean/std) or 'data' (keep data.mean/std)")
    bands = int(cfg.data.bands)
    computed["weights_normalization"] = norm
    for key in ("mean", "std"):
        have = _per_band(cfg.data[key], bands)
        want = [w if w is not None else (have[i] if have else None)
                for i, w in enumerate(norm[key])]
        if None in want or want == have:
            continue
        if policy == "weights":
            run.fill(cfg, f"data.{key}", lambda want=want: want)
            log.info("data.%s from the weights: %s (was %s)", key, want, cfg.data[key])
        else:
            log.warning("data.%s=%s differs from the pretrained weights' %s "
                        "(finetune.normalization=data keeps the data's)", key, have, want)
    if norm.get("scale") is not None and float(cfg.data.scale) != norm["scale"]:
        if policy == "weights":
            run.fill(cfg, "data.scale", lambda: norm["scale"])
        else:
            log.warning("data.scale=%s differs from the weights' %s", cfg.data.scale,
                        norm["scale"])
