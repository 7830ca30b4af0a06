"""Pieces shared by the train and predict entry points (the only readers of DictConfigs)."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf
from torch import nn

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.data.scenes import check_mask_covers
from seg_at_scale.errors import ConfigError, InputError, SegAtScaleError
from seg_at_scale.io import (
    RasterReader,
    check_output_path,
    read_overview,
    write_preview_png,
)
from seg_at_scale.io.zarr_raster import open_raster
from seg_at_scale.metrics import confusion_from_rasters, iou_from_confusion
from seg_at_scale.prediction import PredictionStats, output_kind, predict_raster
from seg_at_scale.tiling import Footprint, footprint

__all__ = ["model_footprint", "normalizer_of", "predict_scene", "preview_path", "format_iou",
           "save_run_config", "RUN_CONFIG", "reports_errors", "class_names_of", "USER_ERROR_EXIT"]

log = logging.getLogger(__name__)

RUN_CONFIG = "run_config.yaml"  # resolved config + computed values, saved with every run
USER_ERROR_EXIT = 2  # exit status of a refused input or config (as argparse's usage errors)

F = TypeVar("F", bound=Callable[..., Any])


def _own_error(exc: BaseException) -> SegAtScaleError | None:
    """The project's error behind ``exc`` (Hydra's ``instantiate`` wraps what it raises)."""
    while exc is not None and not isinstance(exc, SegAtScaleError):
        exc = exc.__cause__  # type: ignore[assignment]
    return exc


def reports_errors(prog: str) -> Callable[[F], F]:
    """Decorate an entry point: the project's own errors print as one line, exit status 2.

    A :class:`~seg_at_scale.errors.SegAtScaleError` already names the file or key, the value
    and the fix; the 30-60 lines of Hydra and library frames above it only bury it.
    ``HYDRA_FULL_ERROR=1`` lets it through with its whole traceback. Put it *under*
    ``@hydra.main`` (Hydra unwraps ``__wrapped__`` to name the job)::

        @hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
        @reports_errors("seg-train")
        def main(cfg: DictConfig) -> None: ...

    Args:
        prog: the command's name, printed before the message.
    """
    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except (SegAtScaleError, InstantiationException) as exc:
                own = _own_error(exc)
                if own is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                print(f"{prog}: error: {own}", file=sys.stderr, flush=True)
                raise SystemExit(USER_ERROR_EXIT) from None

        return run  # type: ignore[return-value]

    return decorate


def class_names_of(data: DictConfig) -> list[str]:
    """``data.class_names``, or ``class_0 .. class_{K-1}`` when it is null.

    Raises:
        ConfigError: a list whose length is not ``data.num_classes``.
    """
    k = int(data.num_classes)
    names = data.get("class_names")
    if names is None:
        return [f"class_{i}" for i in range(k)]
    names = [str(n) for n in names]
    if len(names) != k:
        raise ConfigError(f"data.class_names has {len(names)} names but data.num_classes={k}; "
                          "give one name per class, or data.class_names=null for class_0, "
                          "class_1, ...")
    return names


def model_footprint(model: nn.Module, halo: Any) -> Footprint:
    """The model's footprint; ``halo`` is ``"auto"`` or an int that overrides it."""
    fp = footprint(model)
    if halo in (None, "auto"):
        return fp
    if not isinstance(halo, int) or halo < 0:
        raise ConfigError(f"tiling.halo={halo!r}: use 'auto' or a non-negative int")
    if halo < fp.halo:
        log.warning("tiling.halo=%d is below the model's halo %d: tiles will NOT be exact",
                    halo, fp.halo)
    return Footprint(halo, fp.align, fp.padding, fp.out_residue)


def normalizer_of(data: DictConfig) -> Normalizer:
    """The input normalisation a data config describes."""
    return Normalizer(float(data.scale), tuple(data.mean), tuple(data.std))


def preview_path(output: Path) -> Path:
    """The PNG drawn beside a prediction (never the prediction itself)."""
    return output.with_name(f"{output.name.split('.')[0]}_preview.png")


def predict_scene(model: nn.Module, fp: Footprint, image: Path, output: Path, *,
                  normalizer: Normalizer, tile_size: int | None, q: int | None,
                  fast: bool, overwrite: bool, nodata: float | None = None,
                  mask: Path | None = None, num_classes: int = 0, ignore_index: int = 255,
                  preview: bool = True, class_names: list[str] | None = None,
                  **options: Any) -> dict[str, Any]:
    """Predict one image file whole; optionally score it and draw a preview.

    Every check on the inputs and outputs runs before the model does: the mask's size,
    the band count against the model, existing outputs (``overwrite``).
    ``options`` go to :func:`~seg_at_scale.prediction.predict_raster` (``probabilities``,
    ``tta``, ``batch_size``, ``resume``, ``progress``, ``keep_store``).
    """
    model.eval()
    png = preview_path(output)
    _check_before_work(model, image, output, mask, png if preview else None, overwrite,
                       nodata)
    if fast:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    stats: PredictionStats = predict_raster(
        model, image, output, q=q, tile_size=tile_size, fp=fp, normalizer=normalizer,
        autocast=torch.bfloat16 if fast else None, channels_last=fast, nodata=nodata,
        overwrite=overwrite, class_names=class_names, **options)
    out: dict[str, Any] = {"image": str(image), "prediction": str(output),
                           "tiles": stats.tiles, "efficiency": round(stats.efficiency, 4),
                           "processes": stats.processes,
                           "tiles_computed": stats.tiles_computed,
                           "tiles_resumed": stats.tiles_resumed,
                           "seconds": round(stats.total_s, 2),
                           "mpix_per_s": round(stats.mpix_per_s, 3),
                           "read_s": round(stats.read_s, 2), "model_s": round(stats.model_s, 2),
                           "write_s": round(stats.write_s, 2),
                           "finalize_s": round(stats.finalize_s, 2)}
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return out  # rank 0 scores and draws
    if mask is not None:
        cm = confusion_from_rasters(output, mask, num_classes, ignore_index)
        iou = iou_from_confusion(cm)
        out["iou"] = [None if np.isnan(v) else round(float(v), 4) for v in iou]
        out["miou"] = round(float(np.nanmean(iou)), 4)
        out["pixel_accuracy"] = round(float(np.trace(cm) / max(cm.sum(), 1)), 4)
    if preview:
        with RasterReader(image) as img, open_raster(output) as pred:
            write_preview_png(png, read_overview(img, 1024), read_overview(pred, 1024)[0],
                              num_classes, overwrite=overwrite)
        out["preview"] = str(png)
    return out


def _check_before_work(model: nn.Module, image: Path, output: Path, mask: Path | None,
                       png: Path | None, overwrite: bool, nodata: float | None) -> None:
    """Refuse bad inputs and outputs before any tile is computed."""
    output_kind(output)
    if output.resolve() == image.resolve():
        raise ConfigError(f"output='{output}' is the input image; choose another path")
    if png is not None:
        check_output_path(png, overwrite, key="preview")
    with RasterReader(image, nodata=nodata) as reader:
        bands = getattr(model, "in_channels", None)
        if bands is not None and int(bands) != reader.bands:
            raise InputError(f"image '{image}' has {reader.bands} bands but the model was "
                             f"trained on {bands}; predict an image with {bands} bands")
        if mask is not None:
            if not mask.exists():
                raise InputError(f"mask='{mask}' does not exist; give the ground-truth TIFF "
                                 "or drop mask=")
            with RasterReader(mask) as m:
                check_mask_covers(m, reader)


def format_iou(result: dict[str, Any], class_names: list[str]) -> str:
    """One line per class plus the mean, for the console."""
    lines = [f"  {name:<12s} IoU {v if v is not None else float('nan'):.4f}"
             for name, v in zip(class_names, result.get("iou", []))]
    lines.append(f"  {'mIoU':<12s}     {result.get('miou', float('nan')):.4f}")
    return "\n".join(lines)


def save_run_config(cfg: DictConfig, out_dir: Path, computed: dict[str, Any]) -> Path:
    """Write the resolved config with the computed values (halo, E, ...) into the run."""
    doc = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(doc, dict)
    doc["computed"] = computed
    path = out_dir / RUN_CONFIG
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(doc)))
    return path
