"""A trained model and what predicting with it needs, from a run folder or a model file.

Prediction needs more than weights: the footprint it tiles with (halo, alignment,
padding), the input normalisation, the classes and their names, the training imagery's
sample type. :class:`TrainedModel` carries all of it, described by one *card* (plain
JSON-able data). A run folder's card is made from its ``run_config.yaml`` and checkpoint
(:func:`load_run`); an exported model (``seg-export``, :mod:`seg_at_scale.models.segmodel`)
stores that same card beside its weights, so predicting with either gives the same bytes.

Nothing here runs code from the files: the network is built from the model registry
(:mod:`seg_at_scale.models.registry`) and the checkpoint loaded as plain data
(:mod:`seg_at_scale.models.checkpoint`), unless ``trust`` says otherwise.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

import seg_at_scale
from seg_at_scale.config_check import resolved
from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.errors import ConfigError, InputError
from seg_at_scale.io.preview import default_palette
from seg_at_scale.models.card import ModelCard
from seg_at_scale.models.checkpoint import MEANING_KEY, load_checkpoint, model_state
from seg_at_scale.models.contract import ApproximateFootprint
from seg_at_scale.models.registry import build_model, family_of, for_prediction
from seg_at_scale.models.weights import non_finite
from seg_at_scale.tiling.geometry import Footprint
from seg_at_scale.tiling.halo import footprint as measured_footprint

__all__ = ["TrainedModel", "load_run", "footprint_with_halo", "pick_checkpoint",
           "card_of_config", "tiling_footprint", "prediction_footprint", "load_weights",
           "weights_mismatch",
           "read_run_config", "RUN_CONFIG", "CARD_FORMAT", "MEANING_KEY", "weights_meaning",
           "check_meaning"]

log = logging.getLogger(__name__)

RUN_CONFIG = "run_config.yaml"  # resolved config + computed values, saved with every run
CARD_FORMAT = "seg_at_scale.model/1"


@dataclass(frozen=True)
class TrainedModel:
    """A network in eval mode with everything prediction reads from its card.

    Attributes:
        model: the network, weights loaded, eval mode, on the CPU.
        card: the model card (:class:`~seg_at_scale.models.card.ModelCard`; its data:
            :func:`card_of_run`); the rest is read from it.
        source: where it came from, for messages (``run 'runs/x'``).
        config: the run's config (run folders only; None for a model file).
        checkpoint: the checkpoint file read (run folders only).
    """

    model: nn.Module
    card: ModelCard
    source: str
    config: DictConfig | None = None
    checkpoint: Path | None = None

    @property
    def footprint(self) -> Footprint:
        return self.card.footprint

    @property
    def normalizer(self) -> Normalizer:
        return self.card.normalizer(self.source)

    @property
    def num_classes(self) -> int:
        return self.card.num_classes

    @property
    def class_names(self) -> list[str]:
        return list(self.card.class_names)

    @property
    def ignore_index(self) -> int:
        return self.card.ignore_index

    @property
    def bands(self) -> int:
        return self.card.bands

    @property
    def input(self) -> dict[str, Any]:
        """The training imagery: ``dtype`` and ``high`` (mean + 3 std, raw), where recorded."""
        return dict(self.card.input)


def footprint_with_halo(model: nn.Module, halo: Any) -> Footprint:
    """The model's footprint; ``halo`` is ``"auto"`` or an int that overrides it."""
    fp = measured_footprint(model)
    if halo in (None, "auto"):
        return fp
    if not isinstance(halo, int) or isinstance(halo, bool) or halo < 0:
        raise ConfigError(f"tiling.halo={halo!r}: use 'auto' or a whole number of pixels >= 0")
    if halo < fp.halo:
        log.warning("tiling.halo=%d is below the model's halo %d: tiles will NOT be exact",
                    halo, fp.halo)
    return Footprint(halo, fp.align, fp.padding, fp.out_residue)


def tiling_footprint(model: nn.Module, tiling: Mapping[str, Any]) -> Footprint:
    """The footprint a run tiles with: exact, or the model's approximate one.

    With ``tiling.exact=false`` the tiles overlap by the approximate footprint and do NOT
    reproduce the whole-image forward (networks no tiling makes exact: SE, attention).
    """
    halo = tiling.get("halo", "auto")
    if tiling.get("exact", True):
        return footprint_with_halo(model, halo)
    fp = model.approximate_footprint() if isinstance(model, ApproximateFootprint) \
        else footprint_with_halo(model, "auto")
    if halo not in (None, "auto"):
        fp = Footprint(int(halo), fp.align, fp.padding, fp.out_residue)
    log.warning("tiling.exact=false: tiles (halo %d, align %d) do NOT reproduce the "
                "whole-image computation; predictions are approximate", fp.halo, fp.align)
    return fp


def prediction_footprint(model: nn.Module, tiling: Mapping[str, Any]) -> Footprint:
    """The footprint a trained model predicts with: the run's, never below the exact halo.

    ``tiling.halo`` below the network's halo makes training tiles cheaper and inexact (the
    run logs it); its predictions stay exact, as their result and COG declare, with the
    network's halo. With ``tiling.exact=false``: the run's approximate footprint.
    """
    halo = tiling.get("halo", "auto")
    if (tiling.get("exact", True) and isinstance(halo, int) and not isinstance(halo, bool)
            and 0 <= halo < measured_footprint(model).halo):
        tiling = {**tiling, "halo": "auto"}
    return tiling_footprint(model, tiling)


def _run_above(path: Path) -> str:
    """What to give instead of ``path`` for ``run=``: the run folder above it, if any."""
    if path.suffix == ".segmodel" or (path / "card.json").is_file():
        return f"it is a model seg-export wrote: give model={path}"
    for up in list(path.parents)[:2]:  # checkpoints/ and a checkpoint in it
        if (up / RUN_CONFIG).is_file():
            if path.suffix == ".ckpt":
                return f"it is a checkpoint of the run '{up}': give run={up} ckpt={path.name}"
            return f"it is inside the run '{up}': give run={up}"
    return "give the folder of a training run (it holds run_config.yaml and checkpoints/)"


def read_run_config(run: Path) -> DictConfig:
    """A run folder's ``run_config.yaml``, refused in one line when missing or unreadable."""
    path = run / RUN_CONFIG
    if not path.is_file():
        raise InputError(f"run='{run}' has no {RUN_CONFIG}; {_run_above(run)}")
    try:
        cfg = OmegaConf.load(path)
    except (yaml.YAMLError, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        raise InputError(f"'{path}' is not readable YAML ({first}); restore it from the run "
                         "or a copy") from None
    if not isinstance(cfg, DictConfig) or not isinstance(cfg.get("model"), DictConfig) \
            or not isinstance(cfg.get("data"), DictConfig):
        raise InputError(f"'{path}' holds no model and data sections; it is not the config "
                         "of a training run (restore it from the run or a copy)")
    return cfg


def pick_checkpoint(run: Path, ckpt: str) -> Path:
    """``best`` (highest val/miou in its name), ``last``, a path, or a name in ``checkpoints/``."""
    folder = run / "checkpoints"
    if ckpt not in ("best", "last"):
        path = Path(ckpt)
        if not path.exists() and not path.is_absolute() and (folder / ckpt).is_file():
            path = folder / ckpt  # ckpt=epoch003-miou0.91.ckpt: the run's own
    elif ckpt == "last":
        path = folder / "last.ckpt"
    else:
        ranked = sorted((p for p in folder.glob("*.ckpt") if p.name != "last.ckpt"),
                        key=lambda p: _miou_of(p.name))
        path = ranked[-1] if ranked else folder / "last.ckpt"
    if not path.exists():
        names = sorted(p.name for p in folder.glob("*.ckpt"))
        held = (f" (the run holds {', '.join(names[:6])}{', ...' if len(names) > 6 else ''})"
                if names else " (the run holds none)")
        raise InputError(f"ckpt={ckpt!r}: no checkpoint at '{path}'; use ckpt=last, ckpt=best, "
                         f"the name of one in '{folder}'{held} or a path to a .ckpt file")
    return path


def _miou_of(name: str) -> float:
    try:
        return float(name.rsplit("miou", 1)[1].removesuffix(".ckpt"))
    except (IndexError, ValueError):
        return -1.0


def weights_mismatch(model: nn.Module, state: Mapping[str, Tensor]) -> str | None:
    """How ``state`` fails to fit ``model`` (first keys and shapes), or None when it fits.

    Reads shapes only, so ``model`` may live on the ``meta`` device (nothing allocated).
    """
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [(k, tuple(state[k].shape), tuple(v.shape)) for k, v in own.items()
              if k in state and tuple(state[k].shape) != tuple(v.shape)]
    parts = []
    if shapes:
        k, a, b = shapes[0]
        parts.append(f"{len(shapes)} shapes differ (first {k}: {list(a)} in the weights, "
                     f"{list(b)} in the model)")
    if missing:
        parts.append(f"{len(missing)} weights missing (first {missing[0]})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected (first {unexpected[0]})")
    return "; ".join(parts) or None


def load_weights(model: nn.Module, state: dict[str, Tensor], where: str) -> None:
    """Load ``state`` strictly; a mismatch is one line naming the first keys and shapes."""
    mismatch = weights_mismatch(model, state)
    if mismatch:
        raise InputError(f"{where}: the weights do not fit the model its config describes: "
                         f"{mismatch}. The checkpoint is another run's (predict it with "
                         "run=<that run's folder>, or give one of this run's checkpoints), "
                         "or the config was edited (restore it)")
    # the parameters only: a buffer may hold NaN by design (smp's unset input statistics)
    params = {name for name, _ in model.named_parameters()}
    bad = non_finite({k: v for k, v in state.items() if k in params})
    if bad:  # a diverged run's: every pixel would be labelled 0
        raise InputError(f"{where}: the weights hold NaN or infinite values in {bad[0]} of "
                         f"the {bad[1]} float tensors (first {bad[2]}): the training diverged "
                         "(a loss of nan); use a checkpoint from before it, or train again "
                         "with a lower task.optimizer.lr")
    model.load_state_dict(state)


def weights_meaning(cfg: DictConfig) -> dict[str, Any]:
    """What a run's weights mean: the model's keys, the bands, the classes, the normalisation.

    Saved in each checkpoint the run writes (:data:`MEANING_KEY`), and compared when a run
    folder is loaded: a checkpoint of another run with the same shapes would otherwise be
    used with this run's classes and normalisation, and predict wrong labels.
    """
    node = OmegaConf.to_container(cfg.model, resolve=True)
    assert isinstance(node, dict)
    fam = family_of(str(node.get("_target_")))
    data = cfg.data
    k = int(data.num_classes)
    names = list(data.class_names) if data.get("class_names") else [f"class_{i}"
                                                                     for i in range(k)]
    bands: Any = data.get("bands") or node.get("in_channels") or node.get("planes")  # int() checks
    return {"model": {"family": fam.name if fam else None, **node},
            "data": {"bands": int(bands), "num_classes": k, "class_names": names,
                     "normalization": {"scale": float(data.scale),
                                       "mean": [float(v) for v in data.mean],
                                       "std": [float(v) for v in data.std]}}}


def check_meaning(saved: Any, cfg: DictConfig, where: str) -> None:
    """Refuse a checkpoint written under other model or data keys than ``cfg``'s (named).

    Checkpoints without the record (another tool's, or made by hand) are taken as they are.
    """
    if not isinstance(saved, dict):
        return
    now = weights_meaning(cfg)
    differ = [f"{key}: {a!r} in the checkpoint, {b!r} in the config"
              for key, a, b in _differences(saved, now, "")]
    if differ:
        raise InputError(f"{where} was trained with other keys than the run's config: "
                         f"{'; '.join(differ[:3])}. The checkpoint is another run's (predict "
                         "it with run=<that run's folder>, or give one of this run's "
                         "checkpoints), or the config was edited (restore it)")


def _differences(a: Any, b: Any, key: str) -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str)
                for d in _differences(a.get(k), b.get(k), f"{key}.{k}" if key else str(k))]
    return [] if a == b else [(key, a, b)]


def card_of_config(cfg: DictConfig, fp: Footprint) -> dict[str, Any]:
    """The card of a training config's model: family and keys, footprint, data."""
    meaning = weights_meaning(cfg)
    data = cfg.data
    computed = cfg.get("computed") or {}
    k = int(data.num_classes)
    nodata = data.get("nodata")
    return {
        "format": CARD_FORMAT, "seg_at_scale_version": seg_at_scale.__version__,
        "model": meaning["model"],
        "footprint": {"halo": fp.halo, "align": fp.align, "padding": fp.padding,
                      "out_residue": fp.out_residue},
        "exact": bool((cfg.get("tiling") or {}).get("exact", True)),
        "data": {**meaning["data"],
                 "colours": [list(c) for c in default_palette(k)],
                 "ignore_index": int(data.ignore_index),
                 "nodata": "nan" if isinstance(nodata, float) and math.isnan(nodata)
                 else nodata,  # JSON has no NaN
                 "input": _plain(computed.get("input")),
                 "fingerprint": computed.get("data_fingerprint")},
    }


def card_of_run(cfg: DictConfig, fp: Footprint, run: Path, ckpt: Path,
                ckpt_data: dict[str, Any]) -> dict[str, Any]:
    """The model card of a run (what ``seg-export`` writes beside the weights)."""
    return {**card_of_config(cfg, fp), "metrics": _metrics(run, ckpt, ckpt_data),
            "training": {"run": str(run.resolve()), "checkpoint": ckpt.name,
                         "epoch": ckpt_data.get("epoch"),
                         "global_step": ckpt_data.get("global_step")}}


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def _metrics(run: Path, ckpt: Path, ckpt_data: dict[str, Any]) -> dict[str, Any]:
    """The scores of this checkpoint's weights.

    ``val/miou``: the monitor's value when it was saved; ``test/miou``: the test scenes',
    where the run predicted them with it; ``checkpoint/best_score``: the run's best.
    """
    out: dict[str, Any] = {}
    summary = run / "summary.json"
    doc: dict[str, Any] = {}
    if summary.is_file():
        try:
            doc = json.loads(summary.read_text())
        except (OSError, ValueError):
            doc = {}
    scored = doc.get("checkpoint")  # the checkpoint the summary's scores are of
    this = isinstance(scored, str) and Path(scored).name == ckpt.name
    states = [cb for cb in (ckpt_data.get("callbacks") or {}).values()
              if isinstance(cb, dict) and "best_model_score" in cb]
    own = states[0].get("current_score") if states else None
    if own is not None:
        out["val/miou"] = round(float(own), 6)
    elif this and doc.get("val/miou") is not None:
        out["val/miou"] = doc["val/miou"]
    tests = [t.get("miou") for t in doc.get("test") or [] if isinstance(t, dict)]
    if this and tests:
        out["test/miou"] = tests
    best = states[0].get("best_model_score") if states else None
    if best is not None:
        out["checkpoint/best_score"] = round(float(best), 6)
    return out


def load_run(run: str | os.PathLike[str], ckpt: str = "best", *,
             trust: bool = False) -> TrainedModel:
    """A training run folder's network (``ckpt``: best, last or a path) and its card.

    Raises:
        InputError / ConfigError: no or unreadable config, a model the registry does not
            know, an unreadable or unsafe checkpoint, weights that do not fit the config.
    """
    run = Path(run)
    cfg = read_run_config(run)
    where = f"run '{run}'"
    node = resolved(cfg.model)
    # every tensor comes from the checkpoint: the pretrained weights files need not exist
    model = build_model(for_prediction(node), where=where, trust=trust)
    path = pick_checkpoint(run, ckpt)
    data = load_checkpoint(path, trust=trust)
    check_meaning(data.get(MEANING_KEY), cfg, f"{where}: checkpoint '{path}'")
    load_weights(model, model_state(data), f"{where}, checkpoint '{path}'")
    model.eval()
    fp = prediction_footprint(model, cfg.get("tiling") or {})
    card = card_of_run(cfg, fp, run, path, data)
    return TrainedModel(model, ModelCard.of(card), where, cfg, path)


