"""LightningModule for halo-tiled semantic segmentation.

Optimisation is manual so that whole-image grid training is exact: each tile's loss is
its core's summed pixel loss divided by the whole image's pixel weight (``batch["norm"]``),
gradients accumulate over the image's tiles, and the optimiser steps on the image's last
tile (``batch["last"]``). Random-tile batches carry their own weight and step every batch.
Metrics are named ``{stage}/{name}`` (``val/miou``, ``val/iou_road``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import pytorch_lightning as pl
import torch
from pytorch_lightning.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torchmetrics.classification import MulticlassJaccardIndex

from seg_at_scale.data.samplers import is_pad
from seg_at_scale.errors import ConfigError
from seg_at_scale.parallel.launch import all_reduce_gradients, world_size
from seg_at_scale.tasks.finetune import (
    check_finetune,
    freeze_batch_norm,
    optimizer_groups,
    resolve_freeze_bn,
    set_encoder_trainable,
)
from seg_at_scale.tasks.losses import CrossEntropy

if TYPE_CHECKING:
    from fairscale.nn import Pipe

__all__ = ["SegmentationTask", "poly_lr", "gradient_reduction_for", "REDUCTIONS"]

REDUCTIONS = ("sum", "mean")


def gradient_reduction_for(tiling_mode: str) -> str:
    """How ranks combine gradients for a tiling mode: ``sum`` for grid, ``mean`` for random.

    >>> gradient_reduction_for("grid"), gradient_reduction_for("random")
    ('sum', 'mean')
    """
    return "sum" if tiling_mode == "grid" else "mean"


def poly_lr(optimizer: torch.optim.Optimizer, total_steps: int, power: float = 0.9,
            warmup_steps: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """Polynomial decay ``(1 - step / total)^power`` (the seed's schedule), optional warm-up."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, 1 - step / max(1, total_steps)) ** power

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class SegmentationTask(pl.LightningModule):
    """Train and validate a segmentation network on halo tiles.

    Args:
        model: the network ``[B, C, h, w] -> [B, K, h', w']``.
        num_classes: K.
        class_names: names for per-class metrics (default ``class_k``).
        loss: a pixel loss returning ``(sum, weight)``; default weighted cross-entropy.
        optimizer: partial ``params -> Optimizer`` (Hydra ``_partial_: true``).
        scheduler: partial ``(optimizer, total_steps) -> LRScheduler`` stepped per optimiser
            step, or None.
        ignore_index: label without loss or metric.
        gradient_clip: max gradient norm (0 = off).
        channels_last: NHWC layout for the network (faster convolutions on CPU).
        gradient_reduction: how ranks combine their gradients at an optimiser step:
            ``sum`` when each tile's loss is already divided by its whole image's weight
            (grid tiling: the sum over ranks is the whole-image gradient, exactly), ``mean``
            for batches of random tiles (ordinary data parallelism). The configs set it from
            ``tiling.mode`` (:func:`gradient_reduction_for`).
    """

    def __init__(self, model: nn.Module, num_classes: int, *,
                 class_names: Sequence[str] | None = None, loss: nn.Module | None = None,
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 scheduler: Callable[..., Any] | None = None, ignore_index: int = 255,
                 gradient_clip: float = 0.0, channels_last: bool = False,
                 gradient_reduction: str, freeze_bn: str = "none",
                 freeze_encoder_epochs: int = 0, encoder_lr_scale: float = 1.0) -> None:
        super().__init__()
        if isinstance(gradient_clip, bool) or not isinstance(gradient_clip, int | float) \
                or not gradient_clip >= 0:
            raise ConfigError(f"task.gradient_clip={gradient_clip!r}: give the largest gradient "
                              "norm, a number >= 0 (0: no clipping)")
        check_finetune(model, freeze_bn, freeze_encoder_epochs, encoder_lr_scale)
        self.freeze_bn = resolve_freeze_bn(model, freeze_bn)
        self.freeze_encoder_epochs, self.encoder_lr_scale = freeze_encoder_epochs, encoder_lr_scale
        if gradient_reduction not in REDUCTIONS:
            raise ConfigError(f"task.gradient_reduction={gradient_reduction!r}: use one of "
                              f"{list(REDUCTIONS)} (sum for tiling.mode=grid, mean for random)")
        self.gradient_reduction = gradient_reduction
        class_names = [str(c) for c in class_names] if class_names is not None else None
        self.automatic_optimization = False
        self.model = model
        self.num_classes, self.ignore_index = num_classes, ignore_index
        self.class_names = list(class_names or [f"class_{k}" for k in range(num_classes)])
        self.loss = loss or CrossEntropy(num_classes, ignore_index=ignore_index)
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.gradient_clip, self.channels_last = gradient_clip, channels_last
        # a class with no pixel in target or prediction is NaN, left out of val/miou (as
        # the test scenes' scoring leaves it out), not an IoU of 0
        self.val_iou = MulticlassJaccardIndex(num_classes, average="none",
                                              ignore_index=ignore_index,
                                              zero_division=math.nan)
        self.save_hyperparameters(ignore=["model", "loss", "optimizer", "scheduler"])

    @property
    def pipe(self) -> Pipe | None:
        """The fairscale Pipe running :attr:`model` (``pipeline=manual|auto``), or None."""
        return self.__dict__.get("_pipe")

    def attach_pipeline(self, pipe: nn.Module | None) -> None:
        """Run the network through ``pipe`` (built on this task's model, sharing its weights).

        The Pipe is not a registered submodule: the state dict stays the model's own, so a
        checkpoint loads into the plain model for prediction, and Lightning never tries to
        ``.to()`` the Pipe (which it refuses).
        """
        self.__dict__["_pipe"] = pipe

    def forward(self, x: Tensor) -> Tensor:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        pipe = self.pipe
        if pipe is not None:
            return pipe(x.to(pipe.devices[0]))
        return self.model(x)

    # ----- fine-tuning -----------------------------------------------------------------

    def train(self, mode: bool = True) -> SegmentationTask:
        """As ``nn.Module.train``, with the frozen BatchNorm layers kept in eval mode."""
        super().train(mode)
        if mode and hasattr(self, "freeze_bn"):
            freeze_batch_norm(self.model, self.freeze_bn)
        return self

    def on_train_epoch_start(self) -> None:
        # Lightning's fit never calls train(): the frozen layers are put in eval mode here
        # (validation restores each module's mode as it found it)
        freeze_batch_norm(self.model, self.freeze_bn)
        if self.freeze_encoder_epochs:
            set_encoder_trainable(self.model,
                                  self.current_epoch >= self.freeze_encoder_epochs)

    # ----- training --------------------------------------------------------------------

    def tile_loss(self, batch: dict[str, Tensor]) -> Tensor:
        """One tile's share of its image's loss: core loss sum / the image's pixel weight."""
        logits = self(batch["image"])
        loss_sum, _ = self.loss(logits, batch["target"].to(logits.device))
        norm = batch["norm"].sum().to(loss_sum.device, loss_sum.dtype).clamp_min(1e-12)
        return loss_sum / norm

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = torch.zeros((), dtype=torch.float64)
        if not is_pad(batch):  # pad: a rank's empty slot
            loss = self.tile_loss(batch)
            self.manual_backward(loss)
        self._image_loss = getattr(self, "_image_loss", 0.0) + float(loss.detach())
        if bool(batch["last"].all()):
            self._step_on_image()
        return loss.detach()

    def _step_on_image(self) -> None:
        """The image's last tile: reduce over ranks, clip, step, schedule, log the loss."""
        opt = cast(LightningOptimizer, self.optimizers())  # configure_optimizers gives one
        if world_size() > 1:  # sample parallelism: the whole image's gradient, exactly
            total = all_reduce_gradients(self.parameters(), self.gradient_reduction,
                                         extra=torch.tensor(self._image_loss))
            self._image_loss = float(total)  # type: ignore[arg-type]
        if self.gradient_clip:
            # Lightning takes its optimizer wrapper here (annotated: a torch Optimizer)
            self.clip_gradients(cast(torch.optim.Optimizer, opt),
                                gradient_clip_val=self.gradient_clip,
                                gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched = self.lr_schedulers()
        if sched is not None:
            sched.step()  # type: ignore[union-attr]
        self.log("train/loss", self._image_loss, prog_bar=True, batch_size=1)
        self._image_loss = 0.0

    # ----- validation ------------------------------------------------------------------

    def skip_pad(self, batch: dict[str, Tensor]) -> bool:
        """True for a pad slot (a rank with fewer validation tiles than the others).

        It logs a zero ``val/loss``, so every rank holds the same keys at the epoch-end sync.
        """
        if not is_pad(batch):
            return False
        self.log("val/loss", torch.zeros((), device=self.device), reduce_fx="sum",
                 on_epoch=True, batch_size=1, sync_dist=True)
        return True

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        if self.skip_pad(batch):
            return
        logits = self(batch["image"])
        batch["target"] = batch["target"].to(logits.device)
        loss_sum, _ = self.loss(logits, batch["target"])
        self.log("val/loss", loss_sum / batch["norm"].sum().to(loss_sum.dtype).clamp_min(1e-12),
                 reduce_fx="sum", on_epoch=True, batch_size=1, sync_dist=True)
        self.val_iou.update(logits.argmax(1), batch["target"])

    def on_validation_epoch_end(self) -> None:
        iou = self.val_iou.compute()  # every rank's counts summed: one value on all ranks
        present = ~torch.isnan(iou)
        # "max" of one value keeps it as is, and tells Lightning it is every rank's
        self.log("val/miou", iou[present].mean() if present.any() else torch.tensor(0.0),
                 prog_bar=True, sync_dist=True, reduce_fx="max")
        for name, v in zip(self.class_names, iou):
            self.log(f"val/iou_{name}", v, sync_dist=True, reduce_fx="max")
        self.val_iou.reset()

    # ----- optimisation ----------------------------------------------------------------

    def configure_optimizers(self) -> Any:
        make = self.optimizer_factory or functools.partial(torch.optim.AdamW, lr=1e-3)
        opt = make(optimizer_groups(self.model, self.parameters(), make, self.encoder_lr_scale))
        if self.scheduler_factory is None:
            return opt
        total = self._optimizer_steps()
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.scheduler_factory(
            opt, total_steps=total), "interval": "step"}}

    def _optimizer_steps(self) -> int:
        """Optimiser steps in the whole run (images per epoch in grid mode)."""
        trainer = self.trainer
        if trainer.max_steps and trainer.max_steps > 0:
            return int(trainer.max_steps)
        dm = getattr(trainer, "datamodule", None)  # set by Lightning (not annotated)
        per_epoch = getattr(dm, "optimizer_steps_per_epoch", None)
        if per_epoch is None:  # a plain DataLoader: one step per batch
            return max(1, int(trainer.estimated_stepping_batches))
        return max(1, per_epoch() * int(trainer.max_epochs or 1))
