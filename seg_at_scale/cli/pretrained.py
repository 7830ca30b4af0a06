"""Training with pretrained encoders: which footprint, and whose normalisation.

Entry-point code (it reads the ``DictConfig``): :func:`run_footprint` honours
``tiling.exact``; :func:`use_weights_normalization` gives the data the normalisation the
weights were trained with (``finetune.normalization=weights``), or reports the difference.
"""

from __future__ import annotations

import functools
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

    ``weights`` gives ``data.mean/std`` (and ``data.scale`` when the weights state one) the
    model's recorded normalisation, all of it or none: bands the weights do not cover keep
    the data's values, which must then be given (``auto`` cannot be half filled) and be for
    the same scale; otherwise nothing is applied and the log says why. ``data`` keeps the
    data's and reports a difference. Recorded in the run's computed values either way.
    """
    policy = str((cfg.get("finetune") or {}).get("normalization", "weights"))
    if policy not in ("weights", "data"):
        raise ConfigError(f"finetune.normalization={policy!r}: use 'weights' (the data takes "
                          "the pretrained weights' mean/std) or 'data' (keep data.mean/std)")
    record = getattr(model, "input_normalization", None)
    norm = record() if callable(record) else None
    if norm is None:
        return
    computed["weights_normalization"] = norm
    want, why_not = _from_weights(cfg.data, norm)
    if policy == "weights" and why_not:
        log.warning("finetune.normalization=weights: none of the weights' normalisation is "
                    "applied, data.mean/std/scale stay as given: %s", why_not)
        return
    if policy == "data":
        for key, value in want.items():
            if str(cfg.data[key]) != "auto" and value != _configured(cfg.data, key):
                log.warning("data.%s=%s differs from the pretrained weights' %s "
                            "(finetune.normalization=data keeps the data's)", key,
                            cfg.data[key], value)
        return
    for key, value in want.items():
        if value != _configured(cfg.data, key):
            was = _configured(cfg.data, key)  # a copy: fill replaces the node
            run.fill(cfg, f"data.{key}", functools.partial(_known, value))
            log.info("data.%s from the weights: %s (was %s)", key, value, was)


def _known(value: Any) -> Any:
    """:meth:`RunFolder.fill`'s ``compute`` of a value worked out already."""
    return value


def _configured(data: DictConfig, key: str) -> Any:
    value = data[key]
    if isinstance(value, str):
        return value
    return float(value) if key == "scale" else _per_band(value, int(data.bands))


def _from_weights(data: DictConfig, norm: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The data values the weights' normalisation gives, and why not all of them apply.

    The reason is ``""`` when they do (every band covered, or the others' statistics given
    for the same scale).
    """
    bands = int(data.bands)
    have = {k: _per_band(data[k], bands) for k in ("mean", "std")}
    uncovered = [i for i, m in enumerate(norm["mean"]) if m is None]
    want: dict[str, Any] = {}
    for k in ("mean", "std"):
        given = have[k]
        want[k] = [w if w is not None else (given[i] if given else None)
                   for i, w in enumerate(norm[k])]
    scale = norm.get("scale")
    if scale is not None:
        want["scale"] = float(scale)
    if not uncovered:
        return want, ""
    if None in want["mean"] or None in want["std"]:
        return want, (f"bands {uncovered} have no pretrained statistics and data.mean/std "
                      "are auto; give data.mean and data.std for every band")
    if scale is not None and str(data.scale) != "auto" and float(data.scale) != scale:
        return want, (f"bands {uncovered} keep data.mean/std, given for data.scale="
                      f"{data.scale}, not the weights' {scale}; give data.scale={scale} and "
                      "those bands' statistics at that scale")
    if scale is not None and str(data.scale) == "auto":
        return want, (f"bands {uncovered} keep data.mean/std, but data.scale=auto; give "
                      f"data.scale={scale} (the weights') to apply their statistics")
    return want, ""
