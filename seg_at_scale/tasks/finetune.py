"""Fine-tuning a pretrained encoder as users do it, without losing exact tiling.

* **Frozen BatchNorm** (``freeze_bn``): BatchNorm layers stay in eval mode while training,
  normalising with their running statistics (the pretrained ones in the encoder). This is
  the usual practice for small batches of tiles, and it is also what keeps tiled training
  exact: a train-mode BatchNorm normalises with the statistics of the tile it sees
  (``docs/design.md``, "Where exactness does not hold"). ``all`` freezes every BatchNorm
  (exact), ``encoder`` only the encoder's (the decoder's still see tile statistics: not
  exact), ``auto`` is ``all``
  for a model that loaded pretrained weights and ``none`` otherwise. Their affine weights
  still train.
* **A frozen encoder for the first epochs** (``freeze_encoder_epochs``): its parameters get
  no gradient (AdamW / SGD then leave them, weight decay included, untouched), so the new
  decoder learns first.
* **A lower encoder learning rate** (``encoder_lr_scale``): the encoder's parameters form
  their own optimiser group at ``lr * scale``; the scheduler scales both groups alike.

>>> from torch import nn
>>> net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)).train()
>>> freeze_batch_norm(net, "all"), net[1].training, net.training
(1, False, True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.models.contract import FineTunable

__all__ = ["FREEZE_BN", "freeze_batch_norm", "resolve_freeze_bn", "encoder_parameters",
           "set_encoder_trainable", "optimizer_groups", "check_finetune",
           "check_finetune_values"]

FREEZE_BN = ("auto", "all", "encoder", "none")


def _bn(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def resolve_freeze_bn(model: nn.Module, freeze_bn: str) -> str:
    """``auto``: ``all`` when the model loaded pretrained weights, else ``none``."""
    if freeze_bn not in FREEZE_BN:
        raise ConfigError(f"finetune.freeze_bn={freeze_bn!r}: use one of {list(FREEZE_BN)} "
                          "(all keeps tiled training exact)")
    if freeze_bn != "auto":
        return freeze_bn
    return "all" if isinstance(model, FineTunable) and model.weights_report else "none"


def freeze_batch_norm(model: nn.Module, which: str) -> int:
    """Put the chosen BatchNorm layers in eval mode (call after every ``train()``).

    Returns:
        The number of layers frozen.
    """
    if which == "none":
        return 0
    layers = _bn(model)
    if which == "encoder":  # the encoder's: those holding its parameters
        enc = {id(p) for p in encoder_parameters(model)}
        layers = [m for m in layers if any(id(p) in enc for p in m.parameters())]
    for m in layers:
        m.eval()
    return len(layers)


def encoder_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The encoder's parameters (``model.encoder_parameters()``), or [] for other models."""
    return list(model.encoder_parameters()) if isinstance(model, FineTunable) else []


def set_encoder_trainable(model: nn.Module, trainable: bool) -> int:
    """Switch the encoder's gradients on or off; returns its parameter count."""
    params = encoder_parameters(model)
    for p in params:
        p.requires_grad_(trainable)
    return sum(p.numel() for p in params)


def optimizer_groups(model: nn.Module, params: Iterable[nn.Parameter], make: Callable[..., Any],
                     scale: float) -> list[dict[str, Any]] | Iterable[nn.Parameter]:
    """Parameters as given, or two groups: the rest at ``lr`` and the encoder at ``lr * scale``.

    ``make`` is the optimiser factory (a ``functools.partial`` from Hydra) whose ``lr``
    keyword is the base rate.
    """
    if scale == 1.0:
        return params
    lr = getattr(make, "keywords", {}).get("lr")
    if lr is None:
        raise ConfigError("finetune.encoder_lr_scale needs the optimiser's lr in the config "
                          "(task.optimizer.lr)")
    enc = {id(p) for p in encoder_parameters(model)}
    params = list(params)
    return [{"params": [p for p in params if id(p) not in enc]},
            {"params": [p for p in params if id(p) in enc], "lr": lr * scale,
             "name": "encoder"}]


def check_finetune_values(freeze_bn: object, freeze_encoder_epochs: object,
                          encoder_lr_scale: object) -> None:
    """Refuse fine-tuning values no model could honour (before the model is built)."""
    if freeze_bn not in FREEZE_BN:
        raise ConfigError(f"finetune.freeze_bn={freeze_bn!r}: use one of {list(FREEZE_BN)} "
                          "(all keeps tiled training exact)")
    if isinstance(freeze_encoder_epochs, bool) or not isinstance(freeze_encoder_epochs, int) \
            or freeze_encoder_epochs < 0:
        raise ConfigError(f"finetune.freeze_encoder_epochs={freeze_encoder_epochs!r}: give "
                          "a whole number of epochs >= 0")
    if isinstance(encoder_lr_scale, bool) or not isinstance(encoder_lr_scale, int | float) \
            or not encoder_lr_scale > 0:
        raise ConfigError(f"finetune.encoder_lr_scale={encoder_lr_scale!r}: give a factor > 0 "
                          "(e.g. 0.1)")


def check_finetune(model: nn.Module, freeze_bn: str, freeze_encoder_epochs: int,
                   encoder_lr_scale: float) -> None:
    """Refuse fine-tuning keys the model or their values cannot honour (before any work)."""
    check_finetune_values(freeze_bn, freeze_encoder_epochs, encoder_lr_scale)
    wants, fix = [], []  # the keys that need an encoder, and the values that do without
    if freeze_encoder_epochs != 0:
        wants.append(f"finetune.freeze_encoder_epochs={freeze_encoder_epochs}")
        fix.append("finetune.freeze_encoder_epochs=0")
    if encoder_lr_scale != 1.0:
        wants.append(f"finetune.encoder_lr_scale={encoder_lr_scale}")
        fix.append("finetune.encoder_lr_scale=1.0")
    if freeze_bn == "encoder":
        wants.append("finetune.freeze_bn=encoder")
        fix.append("finetune.freeze_bn=all")
    if wants and not encoder_parameters(model):
        raise ConfigError(f"{', '.join(wants)} need a model with a pretrained encoder "
                          f"({type(model).__name__} has none): give {' '.join(fix)} "
                          "(finetune.freeze_bn=all freezes BatchNorm in any model), or use "
                          "model=unet_resnet34 (or any smp preset) or Gated-SCNN with "
                          "model.backbone=<timm network>")
