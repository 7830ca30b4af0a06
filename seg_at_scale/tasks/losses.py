"""Pixel losses that decompose over pixels, so tile sums add up to the whole-image loss.

A loss here returns ``(sum of pixel losses, sum of pixel weights)`` for a tile; the
whole-image loss is the ratio of the totals. That is exactly PyTorch's weighted
cross-entropy with ``reduction="mean"`` when computed on the whole image, and it is what
makes tiled training exact (``tiled_backward``). Losses that do not decompose over pixels
(Dice, Lovász) can be plugged into the Lightning module too, but tiled training with them
is an approximation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["CrossEntropy", "FocalLoss"]


def _full(logits: Tensor) -> Tensor:
    """Half-precision logits are upcast: the loss is summed over millions of pixels."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


class CrossEntropy(nn.Module):
    """Weighted cross-entropy with an ignore index.

    Args:
        num_classes: number of classes K.
        class_weights: optional per-class weights (length K).
        ignore_index: target value that contributes nothing.

    Shapes:
        logits ``[B, K, H, W]``, target ``[B, H, W]`` -> two scalars.
    """

    class_weights: Tensor  # a buffer

    def __init__(self, num_classes: int, class_weights: Sequence[float] | None = None,
                 ignore_index: int = 255) -> None:
        super().__init__()
        w = torch.ones(num_classes) if class_weights is None else torch.tensor(
            list(class_weights), dtype=torch.float32)
        if w.numel() != num_classes:
            raise ValueError(f"loss.class_weights has {w.numel()} values for {num_classes} "
                             "classes; give one weight per class")
        self.register_buffer("class_weights", w)
        self.num_classes, self.ignore_index = num_classes, ignore_index

    def pixel_weight(self, target: Tensor) -> Tensor:
        """Weight of each target pixel (0 where ignored): ``[B, H, W]``."""
        valid = target != self.ignore_index
        w = self.class_weights.to(target.device)[target.clamp(0, self.num_classes - 1).long()]
        return w * valid

    def pixel_loss(self, logits: Tensor, target: Tensor) -> Tensor:
        """Weighted per-pixel loss ``[B, H, W]`` (0 where ignored)."""
        nll = F.cross_entropy(_full(logits), target.long(), reduction="none",
                              ignore_index=self.ignore_index)
        return nll * self.pixel_weight(target)

    def forward(self, logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        return self.pixel_loss(logits, target).sum(), self.pixel_weight(target).sum()


class FocalLoss(CrossEntropy):
    """Focal loss (Lin et al. 2017): cross-entropy scaled by ``(1 - p_t)^gamma``."""

    def __init__(self, num_classes: int, class_weights: Sequence[float] | None = None,
                 ignore_index: int = 255, gamma: float = 2.0) -> None:
        super().__init__(num_classes, class_weights, ignore_index)
        self.gamma = gamma

    def pixel_loss(self, logits: Tensor, target: Tensor) -> Tensor:
        nll = F.cross_entropy(_full(logits), target.long(), reduction="none",
                              ignore_index=self.ignore_index)
        return (1 - torch.exp(-nll)) ** self.gamma * nll * self.pixel_weight(target)
