"""The model a command names: ``run=`` (a training run folder) or ``model=`` (seg-export).

:func:`load_trained` builds it (network, weights, card); :func:`peek_card` reads only its card,
for the checks that run before any network is built; :func:`model_files` names the files it is
read from, which no output may replace.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

from seg_at_scale.errors import ConfigError, InputError
from seg_at_scale.models.card import ModelCard
from seg_at_scale.models.segmodel import read_card, read_model
from seg_at_scale.models.trained import (
    RUN_CONFIG,
    TrainedModel,
    card_of_config,
    load_run,
    pick_checkpoint,
    read_run_config,
)
from seg_at_scale.tiling.geometry import Footprint, Padding

__all__ = ["load_trained", "model_files", "peek_card"]


def load_trained(run: str | os.PathLike[str] | None = None,
                 model: str | os.PathLike[str] | None = None, *, ckpt: str | None = None,
                 trust: bool = False) -> TrainedModel:
    """The model ``run=`` (a training run folder) or ``model=`` (a seg-export file) names.

    ``ckpt`` chooses among a run's checkpoints (None: ``best``); a model file holds one set
    of weights, and a ``ckpt`` given with it is refused rather than ignored.
    """
    _check_named(run, model, ckpt)
    if run is not None:
        return load_run(run, ckpt or "best", trust=trust)
    assert model is not None
    return read_model(model, trust=trust)


def _check_named(run: str | os.PathLike[str] | None, model: str | os.PathLike[str] | None,
                 ckpt: str | None) -> None:
    if (run is None) == (model is None):
        raise ConfigError("give the model to predict with as run=<training run folder> or "
                          "model=<file made by seg-export>, one of them"
                          + (" (both were given)" if run is not None else ""))
    if model is not None and ckpt is not None:
        raise ConfigError(f"ckpt={ckpt!r} chooses among a training run's checkpoints, but "
                          f"model='{model}' holds one set of weights; leave ckpt out, or "
                          "export the checkpoint you want (seg-export run=<run> ckpt=... "
                          "output=...), or predict with run=<run> ckpt=...")


def model_files(run: str | os.PathLike[str] | None, model: str | os.PathLike[str] | None,
                ckpt: str | None = None) -> dict[str, Path]:
    """The files a model is read from (no output may replace them), by what users call them."""
    if run is not None:
        return {"run config": Path(run) / RUN_CONFIG,
                "checkpoint": pick_checkpoint(Path(run), ckpt or "best")}
    return {"model": Path(model)} if model is not None else {}


def peek_card(run: str | os.PathLike[str] | None, model: str | os.PathLike[str] | None,
              ckpt: str | None = None) -> tuple[ModelCard, str]:
    """A model's card and name without building the network or loading weights.

    The launching process of a multi-process prediction checks every input with it before
    forking its ranks: it must run no torch computation (OpenMP does not survive a fork).
    A run's footprint is the one its training computed (``computed`` in its config); the
    ranks compare it with the network's own.
    """
    _check_named(run, model, ckpt)
    if model is not None:
        return ModelCard.of(read_card(Path(model))), f"model '{model}'"
    assert run is not None
    cfg = read_run_config(Path(run))
    pick_checkpoint(Path(run), ckpt or "best")
    c = cfg.get("computed") or {}
    if not all(k in c for k in ("halo", "align", "padding", "out_residue")):
        raise InputError(f"'{Path(run) / RUN_CONFIG}' has no computed footprint (halo, align, "
                         "padding); predict with processes=1, or export the run with seg-export")
    fp = Footprint(int(c.get("predict_halo", c["halo"])), int(c["align"]),
                   cast(Padding, str(c["padding"])),  # Footprint checks it
                   int(c["out_residue"]))
    return ModelCard.of(card_of_config(cfg, fp)), f"run '{run}'"
