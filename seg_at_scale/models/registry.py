"""The model families a run or a model file may name: nothing else is ever constructed.

A run folder (``run_config.yaml``) or an exported model (its card) names its network by a
``_target_`` and keyword arguments. Building it with ``hydra.utils.instantiate`` would call
*any* importable callable the file names (``_target_: torch.load`` with a pickled payload
runs code). So prediction and export build models here instead: the target must be a
registered family, every key must be one of its constructor's parameters, and every value
must have the parameter's type; only then is the class called, with plain values (a nested
``_target_`` stays a plain dict). ``trust=True`` (``trust_run=true`` on the command line)
lifts these checks for a sender the user trusts, and says so in the log.

A new family registers itself with :func:`register` (one line beside its class).

>>> from seg_at_scale.models.registry import build_model
>>> net = build_model({"_target_": "seg_at_scale.models.UNet", "in_channels": 4,
...                    "num_classes": 3, "levels": 3, "base_width": 8, "padding": "same"},
...                   where="example")
>>> type(net).__name__, net.levels
('UNet', 3)
>>> build_model({"_target_": "torch.load"}, where="run")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
seg_at_scale.errors.ConfigError: run: model._target_='torch.load' is not a seg_at_scale model; ...
"""

from __future__ import annotations

import importlib
import inspect
import logging
import typing
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from seg_at_scale.config_check import check_types, known_keys
from seg_at_scale.errors import TRUST_HINT, ConfigError
from seg_at_scale.models.contract import check_contract

__all__ = ["Family", "register", "families", "family_of", "check_model_config",
           "build_model", "without_weight_files", "for_prediction",
           "predicting"]

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Family:
    """A model family: its short name, the ``_target_`` configs use, and the class.

    Attributes:
        name: short name (``unet``), as in ``conf/model_family/<name>.yaml``.
        target: the dotted path configs write (``seg_at_scale.models.UNet``).
        source: the ``nn.Module`` subclass built from the keys, or ``"module:Class"``,
            imported when the family is first used (a U-Net run never imports smp).
        aliases: other dotted paths of the same class (its defining module).
        weight_keys: keys that name pretrained weights files (and what only they give
            meaning, such as a band map): a checkpoint replaces every tensor they load.
        predict_keys: ``(key, value)`` a trained network is rebuilt with to predict, where
            training chose otherwise (Gated-SCNN's ``output="seg"``: the classes' logits
            alone, not the boundary its pipelines carry along).
    """

    name: str
    target: str
    source: type[nn.Module] | str
    aliases: tuple[str, ...] = field(default=())
    weight_keys: tuple[str, ...] = field(default=())
    predict_keys: tuple[tuple[str, Any], ...] = field(default=())

    @property
    def cls(self) -> type[nn.Module]:
        """The class (its module imported on first use)."""
        if isinstance(self.source, str):
            module, _, name = self.source.partition(":")
            cls: type[nn.Module] = getattr(importlib.import_module(module), name)
            return cls
        return self.source

    def parameters(self) -> dict[str, inspect.Parameter]:
        """The constructor's keyword parameters (``self`` and ``**kwargs`` left out)."""
        sig = inspect.signature(self.cls.__init__)
        return {k: p for k, p in sig.parameters.items() if k != "self" and p.kind in
                (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    def hints(self) -> dict[str, Any]:
        """The constructor's resolved type hints."""
        return typing.get_type_hints(self.cls.__init__)


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family (its target and aliases then name it); returns it."""
    _FAMILIES[family.name] = family
    return family


def families() -> list[Family]:
    """Every registered family, by name."""
    _load_builtin()
    return [_FAMILIES[k] for k in sorted(_FAMILIES)]


def family_of(target: str) -> Family | None:
    """The family a ``_target_`` names, or None."""
    for fam in families():
        if target == fam.target or target in fam.aliases:
            return fam
    return None


def _listing() -> str:
    return ", ".join(f"{f.name} ({f.target})" for f in families())


def check_model_config(node: Mapping[str, Any], *, where: str) -> tuple[Family, dict[str, Any]]:
    """Validate a model config against the registry; the family and its keyword arguments.

    Args:
        node: the ``model`` node as plain data (``_target_`` plus keys).
        where: what the config came from, for messages (``run 'runs/x'``).

    Raises:
        ConfigError: an unregistered target, an unknown key, a missing required key, or a
            value of the wrong type; nothing has been constructed.
    """
    if not isinstance(node, Mapping):
        raise ConfigError(f"{where}: model is {type(node).__name__}, not a mapping of keys; "
                          "give a model node with _target_ and its keys")
    target = node.get("_target_")
    fam = family_of(str(target)) if isinstance(target, str) else None
    if fam is None:
        raise ConfigError(f"{where}: model._target_={target!r} is not a seg_at_scale model; "
                          f"the model families are {_listing()}; {TRUST_HINT}")
    params = fam.parameters()
    kwargs = known_keys("model", {k: v for k, v in node.items() if not str(k).startswith("_")},
                        params, where=f"{where} ({fam.name} model)",
                        required=[k for k, p in params.items() if p.default is p.empty])
    check_types("model", kwargs, fam.hints(), where=where)
    return fam, kwargs


def build_model(node: Mapping[str, Any], *, where: str, trust: bool = False) -> nn.Module:
    """The network a config names, built from the registry only (see the module docstring).

    Args:
        node: the ``model`` node as plain data.
        where: what the config came from, for messages.
        trust: build any ``_target_`` with Hydra, unchecked (logged).
    """
    if trust:
        target = node.get("_target_") if isinstance(node, Mapping) else None
        if not isinstance(target, str) or family_of(target) is None:
            from hydra.utils import instantiate

            log.warning("%s: trust_run=true: building model._target_=%r unchecked (this can "
                        "run any code the config names)", where, target)
            return instantiate(dict(node), _convert_="all")
        try:
            fam, kwargs = check_model_config(node, where=where)
        except ConfigError as exc:
            log.warning("trust_run=true: building despite: %s", exc)
            from hydra.utils import instantiate

            return instantiate(dict(node), _convert_="all")
        return check_contract(fam.cls(**kwargs))
    fam, kwargs = check_model_config(node, where=where)
    return check_contract(fam.cls(**kwargs))


def without_weight_files(node: Mapping[str, Any]) -> dict[str, Any]:
    """The model node with its family's pretrained-weights keys set to null.

    For a model whose checkpoint will be loaded (prediction, export): every tensor comes from
    the checkpoint, so the original weights files need not exist where it runs. Shapes do
    not depend on these keys; the weights' normalisation travels in the checkpoint too
    (smp's ``input_mean`` / ``input_std`` buffers).
    """
    out = dict(node)
    target = out.get("_target_")
    fam = family_of(str(target)) if isinstance(target, str) else None
    for key in fam.weight_keys if fam is not None else ():
        if key in out:
            out[key] = None
    return out


def for_prediction(node: Mapping[str, Any]) -> dict[str, Any]:
    """The node a trained network is rebuilt from to predict.

    No weights files (the checkpoint holds every tensor, :func:`without_weight_files`), and
    its family's ``predict_keys``; the weights fit either way.
    """
    out = without_weight_files(node)
    target = out.get("_target_")
    fam = family_of(str(target)) if isinstance(target, str) else None
    for key, value in fam.predict_keys if fam is not None else ():
        if key in out:
            out[key] = value
    return out


@contextmanager
def predicting(model: nn.Module, node: Mapping[str, Any]) -> Iterator[nn.Module]:
    """``model``, built from ``node``, predicting as :func:`for_prediction` rebuilds it.

    For the while, each of its family's ``predict_keys`` that ``node`` sets otherwise is set
    on the network (these keys are attributes its ``forward`` reads); restored after.
    """
    target = node.get("_target_")
    fam = family_of(str(target)) if isinstance(target, str) else None
    wanted = {key: value for key, value in (fam.predict_keys if fam else ())
              if key in node and node[key] != value}
    for key, value in wanted.items():
        setattr(model, key, value)
    try:
        yield model
    finally:
        for key in wanted:
            setattr(model, key, node[key])


def _load_builtin() -> None:
    """Register the project's own families, by name.

    A family's module is imported, with what it needs, when a config names it.
    """
    if {"unet", "uresnet", "gscnn", "smp"} <= _FAMILIES.keys():
        return
    register(Family("unet", "seg_at_scale.models.UNet", "seg_at_scale.models.unet:UNet",
                    ("seg_at_scale.models.unet.UNet",)))
    register(Family("uresnet", "seg_at_scale.models.UResNet",
                    "seg_at_scale.models.uresnet:UResNet",
                    ("seg_at_scale.models.uresnet.UResNet",)))
    register(Family("gscnn", "seg_at_scale.models.GSCNN", "seg_at_scale.models.gscnn:GSCNN",
                    ("seg_at_scale.models.gscnn.GSCNN",), ("backbone_weights", "band_map"),
                    (("output", "seg"),)))
    register(Family("smp", "seg_at_scale.models.SMPModel", "seg_at_scale.models.smp:SMPModel",
                    ("seg_at_scale.models.smp.SMPModel",),
                    ("encoder_weights", "weights", "band_map")))
