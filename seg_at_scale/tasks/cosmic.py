"""Cosmic tagging: the loss balancing and metrics the neutrino-physics users know.

Logits are ``[B, P * K, H, W]`` (plane ``p``'s class ``k`` at channel ``p * K + k``, see
:mod:`seg_at_scale.models.uresnet`) and targets ``[B, P, H, W]`` with classes 0
background, 1 cosmic, 2 neutrino (255 = ignore).

Loss balancing (``balance``), as in CosmicTagger's options:

* ``none``: plain cross-entropy, mean over labelled pixels;
* ``light``: class weights ``(1, 1.5, 10)``;
* ``even``: weights from the class frequencies of the batch, ``w_k = N / (K' n_k)`` (``n_k``
  labelled pixels of class ``k``, ``N`` all labelled pixels, ``K'`` classes present), so
  every present class contributes the same total weight ``N / K'``; ``even_power = p``
  softens this to ``w_k = (N / (K' n_k))^p`` (``p = 0.5``: inverse square-root frequency,
  a common middle ground between ``none`` and ``even`` for very rare classes);
* ``focal``: ``(1 - p_t)^gamma`` times the cross-entropy (Lin et al. 2017), unweighted.

The loss returns ``(sum, weight)`` like :mod:`seg_at_scale.tasks.losses`; the mean is
``sum / weight``. ``even`` weights depend on the whole target: for exact tiled training use
``loss.frozen(whole_target)``, which fixes them from the whole image.

Metrics, from a confusion matrix per plane (:func:`cosmic_metrics`): total accuracy,
non-background accuracy (accuracy over pixels whose *label* is cosmic or neutrino),
cosmic IoU, neutrino IoU, and ``miou = mean(cosmic IoU, neutrino IoU)``; each per plane
(``plane{p}_...``) and averaged over planes. A class absent from both the labels and the
prediction of a plane has an undefined IoU (NaN), left out of the means.

>>> cm = torch.zeros(1, 3, 3, dtype=torch.int64)
>>> cm[0] = torch.tensor([[90, 0, 0], [0, 6, 2], [0, 0, 2]])  # rows: label, cols: prediction
>>> m = cosmic_metrics(cm)
>>> m["acc"], m["acc_nonbg"], m["iou_cosmic"], m["iou_neutrino"], m["miou"]
(0.98, 0.8, 0.75, 0.5, 0.625)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.models.uresnet import plane_view
from seg_at_scale.tasks.segmentation import SegmentationTask

__all__ = ["CosmicLoss", "cosmic_confusion", "cosmic_metrics", "CosmicTask", "BALANCES",
           "LIGHT_WEIGHTS"]

BALANCES = ("none", "light", "even", "focal")
LIGHT_WEIGHTS = (1.0, 1.5, 10.0)


class CosmicLoss(nn.Module):
    """Per-plane cross-entropy with CosmicTagger's loss balancing (module docstring).

    Args:
        planes: P.
        num_classes: K (3: background, cosmic, neutrino).
        balance: ``"none"``, ``"light"``, ``"even"`` or ``"focal"``.
        gamma: focal exponent.
        ignore_index: target value without loss.
        light_weights: the ``light`` class weights.
        even_power: exponent ``p`` of the ``even`` weights (1 = CosmicTagger's ``even``).
    """

    def __init__(self, planes: int = 3, num_classes: int = 3, balance: str = "light",
                 gamma: float = 2.0, ignore_index: int = 255,
                 light_weights: Sequence[float] = LIGHT_WEIGHTS,
                 even_power: float = 1.0) -> None:
        super().__init__()
        if balance not in BALANCES:
            raise ConfigError(f"task.balance={balance!r}: use one of {', '.join(BALANCES)}")
        if not 0.0 < even_power <= 1.0:
            raise ConfigError(f"task.even_power={even_power!r}: use a value in (0, 1] "
                              "(1 = even, 0.5 = inverse square-root frequency)")
        if balance == "light" and len(light_weights) != num_classes:
            raise ConfigError(f"task.light_weights has {len(light_weights)} values for "
                              f"{num_classes} classes; give one per class")
        self.planes, self.num_classes, self.balance = planes, num_classes, balance
        self.gamma, self.ignore_index = gamma, ignore_index
        self.light_weights = tuple(float(w) for w in light_weights)
        self.even_power = float(even_power)
        self.fixed_weights: Tensor | None = None

    def class_weights(self, target: Tensor) -> Tensor:
        """Weight of each class ``[K]`` for this target (batch frequencies for ``even``)."""
        if self.fixed_weights is not None:
            return self.fixed_weights.to(target.device)
        if self.balance == "light":
            return torch.tensor(self.light_weights, device=target.device)
        if self.balance != "even":
            return torch.ones(self.num_classes, device=target.device)
        valid = target[target != self.ignore_index].long()
        counts = torch.bincount(valid, minlength=self.num_classes)[: self.num_classes].double()
        present = counts > 0
        w = torch.zeros(self.num_classes, dtype=torch.float64, device=target.device)
        w[present] = (counts.sum() / (present.sum() * counts[present])) ** self.even_power
        return w.float()

    def frozen(self, target: Tensor) -> CosmicLoss:
        """A copy whose class weights are fixed from ``target`` (a whole image)."""
        out = copy.copy(self)
        out.fixed_weights = self.class_weights(target).detach().cpu()
        return out

    def pixel_weight(self, target: Tensor) -> Tensor:
        """Weight of each target pixel ``[B, P, H, W]`` (0 where ignored)."""
        valid = target != self.ignore_index
        w = self.class_weights(target)[target.clamp(0, self.num_classes - 1).long()]
        return w * valid

    def pixel_loss(self, logits: Tensor, target: Tensor) -> Tensor:
        """Weighted per-pixel loss ``[B, P, H, W]`` (0 where ignored)."""
        x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        nll = F.cross_entropy(plane_view(x, self.planes), target.long(), reduction="none",
                              ignore_index=self.ignore_index)
        if self.balance == "focal":
            nll = (1 - torch.exp(-nll)) ** self.gamma * nll
        return nll * self.pixel_weight(target)

    def forward(self, logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        return self.pixel_loss(logits, target).sum(), self.pixel_weight(target).sum()

    def extra_repr(self) -> str:
        power = f", even_power={self.even_power:g}" if self.balance == "even" else ""
        return f"balance={self.balance}{power}, planes={self.planes}"


def cosmic_confusion(pred: Tensor, target: Tensor, num_classes: int = 3,
                     ignore_index: int = 255) -> Tensor:
    """Confusion matrices ``[P, K, K]`` (rows: label, columns: prediction) of ``[B, P, H, W]``."""
    planes = target.shape[1]
    out = torch.zeros(planes, num_classes, num_classes, dtype=torch.int64)
    for p in range(planes):
        t, y = target[:, p].reshape(-1), pred[:, p].reshape(-1)
        keep = t != ignore_index
        idx = t[keep].long() * num_classes + y[keep].long()
        out[p] = torch.bincount(idx.cpu(), minlength=num_classes**2).reshape(
            num_classes, num_classes)
    return out


def _plane_metrics(cm: Tensor) -> dict[str, float]:
    cm = cm.double()
    total = float(cm.sum())
    tp = cm.diagonal()
    nonbg = float(cm[1:].sum())

    def iou(k: int) -> float:
        union = float(cm[k].sum() + cm[:, k].sum() - tp[k])
        return float(tp[k]) / union if union else math.nan

    ious = [iou(1), iou(2)]
    defined = [v for v in ious if not math.isnan(v)]
    return {"acc": float(tp.sum()) / total if total else math.nan,
            "acc_nonbg": float(tp[1:].sum()) / nonbg if nonbg else math.nan,
            "iou_cosmic": ious[0], "iou_neutrino": ious[1],
            "miou": sum(defined) / len(defined) if defined else math.nan}


def cosmic_metrics(confusion: Tensor) -> dict[str, float]:
    """Per-plane metrics ``plane{p}_<name>`` and their plane means ``<name>`` (docstring)."""
    per = [_plane_metrics(cm) for cm in confusion]
    out: dict[str, float] = {}
    for name in per[0]:
        values = [m[name] for m in per]
        defined = [v for v in values if not math.isnan(v)]
        out[name] = sum(defined) / len(defined) if defined else math.nan
        for p, v in enumerate(values):
            out[f"plane{p}_{name}"] = v
    return out


class CosmicTask(SegmentationTask):
    """:class:`SegmentationTask` for planes ``[B, P, H, W]`` with the cosmic loss and metrics.

    Random-tile batches are normalised by their own pixel weight (``sum / weight``, the
    balanced mean); whole-image grid tiles by the image's weight from the data module, as
    in the parent (set ``data.class_weights`` to the balance's weights for exactness).
    Logs ``val/loss``, ``val/miou`` (cosmic/neutrino mIoU), ``val/acc``, ``val/acc_nonbg``,
    ``val/iou_cosmic``, ``val/iou_neutrino`` and each per plane (``val/plane0_miou`` ...).

    Args:
        model: a network ``[B, P, h, w] -> [B, P * K, h, w]``, e.g. :class:`UResNet`.
        planes: P.
        num_classes: K.
        balance: loss balancing (module docstring).
        gamma: focal exponent.
        light_weights: the ``light`` class weights (CosmicTagger's 1, 1.5, 10 by default).
        even_power: exponent of the ``even`` weights (:class:`CosmicLoss`).
        class_names: names of the K classes.
        optimizer, scheduler, ignore_index, gradient_clip, channels_last, gradient_reduction:
            as the parent.
    """

    loss: CosmicLoss

    def __init__(self, model: nn.Module, planes: int = 3, num_classes: int = 3, *,
                 balance: str = "light", gamma: float = 2.0,
                 light_weights: Sequence[float] = LIGHT_WEIGHTS, even_power: float = 1.0,
                 class_names: Sequence[str] | None = None,
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 scheduler: Callable[..., Any] | None = None, ignore_index: int = 255,
                 gradient_clip: float = 0.0, channels_last: bool = False,
                 gradient_reduction: str, freeze_bn: str = "none",
                 freeze_encoder_epochs: int = 0, encoder_lr_scale: float = 1.0) -> None:
        loss = CosmicLoss(planes, num_classes, balance, gamma, ignore_index,
                          light_weights, even_power)
        super().__init__(model, num_classes, class_names=class_names, loss=loss,
                         optimizer=optimizer, scheduler=scheduler, ignore_index=ignore_index,
                         gradient_clip=gradient_clip, channels_last=channels_last,
                         gradient_reduction=gradient_reduction, freeze_bn=freeze_bn,
                         freeze_encoder_epochs=freeze_encoder_epochs,
                         encoder_lr_scale=encoder_lr_scale)
        self.planes = planes
        self.confusion = torch.zeros(planes, num_classes, num_classes, dtype=torch.int64)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        if "core" not in batch:  # random tiles: the batch's own balanced mean
            norm = self.loss.pixel_weight(batch["target"]).sum().double().reshape(1)
            batch = {**batch, "norm": norm}
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        if self.skip_pad(batch):
            return
        logits = self(batch["image"])
        loss_sum, weight = self.loss(logits, batch["target"])
        norm = batch["norm"].sum() if "core" in batch else weight
        self.log("val/loss", loss_sum / norm.to(loss_sum.dtype).clamp_min(1e-12),
                 reduce_fx="sum", on_epoch=True, batch_size=1, sync_dist=True)
        pred = plane_view(logits, self.planes).argmax(1)
        self.confusion += cosmic_confusion(pred, batch["target"], self.num_classes,
                                           self.ignore_index)

    def on_validation_epoch_end(self) -> None:
        cm = self.confusion.to(self.device)
        if self.trainer.world_size > 1:
            cm = self.trainer.strategy.reduce(cm, reduce_op="sum")
        metrics = cosmic_metrics(cm.cpu())
        for name, value in metrics.items():
            v = 0.0 if math.isnan(value) else value
            # the summed counts: one value on every rank, kept as is by "max"
            self.log(f"val/{name}", v, prog_bar=name == "miou", sync_dist=True,
                     reduce_fx="max")
        self.confusion.zero_()
