"""Gated-SCNN's losses, boundary targets, boundary F-score, and its LightningModule.

The loss (Takikawa et al. 2019, sec. 3.3-3.4) is a weighted sum of four terms, each a
``(sum, weight)`` pair like the project's pixel losses:

* ``seg``: cross-entropy of the segmentation (ignore index excluded);
* ``edge``: class-balanced binary cross-entropy of the boundary logits against boundaries
  computed from the mask, ``-β y log σ(z) - (1 - β)(1 - y) log(1 - σ(z))`` with ``β`` the
  fraction of non-boundary pixels;
* ``dual`` (the paper's L_reg→): ``|ζ - ζ̂|`` summed over valid pixels, where
  ``ζ = ‖∇ softmax(seg / τ)‖ / √2`` is the boundary magnitude of the predicted segmentation
  (forward differences, summed over classes) and ``ζ̂`` the same of the one-hot ground truth
  (the paper's Gaussian smoothing is left out; ``τ`` stands in for its Gumbel softmax);
* ``att`` (the paper's L_reg←, "thresholded segmentation loss"): cross-entropy at the pixels
  whose boundary probability exceeds ``threshold`` (0.8 in the paper).

The boundary F-score (the paper's table 3) compares, per class, the boundary pixels of the
predicted and true class masks within a pixel tolerance.
"""

from __future__ import annotations

import logging
import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.memory.modes import MemoryWrapped
from seg_at_scale.models.contract import DualOutput
from seg_at_scale.models.gscnn import unpack
from seg_at_scale.tasks.segmentation import SegmentationTask
from seg_at_scale.tiling.statistics import uses_image_pool

__all__ = ["GSCNNLoss", "GSCNNTask", "boundary_targets", "boundary_magnitude",
           "boundary_f_counts", "boundary_f_score"]

log = logging.getLogger(__name__)
Terms = dict[str, tuple[Tensor, Tensor]]


def boundary_targets(target: Tensor, radius: int = 1, ignore_index: int = 255) -> Tensor:
    """Boundary map of a label map ``[B, H, W]`` -> ``[B, H, W]`` float in {0, 1}.

    A valid pixel is a boundary when a valid pixel within ``radius`` (Chebyshev distance)
    has another label; ignored pixels are never boundaries and create none.
    """
    t = target.long()
    padded = F.pad(t, (radius,) * 4, value=ignore_index)
    h, w = t.shape[-2:]
    edge = torch.zeros_like(t, dtype=torch.bool)
    for dy in range(2 * radius + 1):
        for dx in range(2 * radius + 1):
            nb = padded[..., dy : dy + h, dx : dx + w]
            edge |= (nb != ignore_index) & (nb != t)
    return (edge & (t != ignore_index)).float()


def boundary_magnitude(maps: Tensor) -> Tensor:
    """``ζ = sqrt(Σ_k (∂x m_k)² + (∂y m_k)²) / √2`` for maps ``[B, K, H, W]`` -> ``[B, H, W]``.

    Forward differences; the last row / column has a zero difference along that axis. A
    step between two one-hot classes has magnitude 1.
    """
    dx = F.pad(maps[..., :, 1:] - maps[..., :, :-1], (0, 1))
    dy = F.pad(maps[..., 1:, :] - maps[..., :-1, :], (0, 0, 0, 1))
    sq = (dx**2 + dy**2).sum(dim=1)
    return torch.sqrt(sq + 1e-12) / math.sqrt(2.0)


class GSCNNLoss(nn.Module):
    """The Gated-SCNN loss terms (see the module docstring).

    Args:
        num_classes: K.
        ignore_index: label without loss.
        seg_weight: λ of the segmentation cross-entropy.
        edge_weight: λ of the boundary BCE (20 in the paper's code base; configurable).
        dual_weight: λ of the boundary-consistency regulariser (L_reg→).
        att_weight: λ of the thresholded segmentation loss (L_reg←).
        threshold: boundary probability above which L_reg← counts a pixel.
        tau: softmax temperature of the predicted segmentation in L_reg→.
        radius: boundary target radius in pixels.
    """

    def __init__(self, num_classes: int, ignore_index: int = 255, *, seg_weight: float = 1.0,
                 edge_weight: float = 20.0, dual_weight: float = 1.0, att_weight: float = 1.0,
                 threshold: float = 0.8, tau: float = 1.0, radius: int = 1) -> None:
        super().__init__()
        if not 0.0 < threshold < 1.0 or tau <= 0 or radius < 1:
            raise ConfigError(f"task.loss: threshold={threshold} must be in (0, 1), tau={tau} "
                              f"> 0, radius={radius} >= 1")
        self.num_classes, self.ignore_index = num_classes, ignore_index
        self.weights = {"seg": seg_weight, "edge": edge_weight, "dual": dual_weight,
                        "att": att_weight}
        self.threshold, self.tau, self.radius = threshold, tau, radius

    def terms(self, seg: Tensor, edge: Tensor, target: Tensor) -> Terms:
        """Every term as ``(sum, weight)``.

        Args:
            seg: segmentation logits ``[B, K, H, W]``.
            edge: boundary logits ``[B, 1, H, W]``.
            target: labels ``[B, H, W]``.
        """
        seg, edge = seg.float(), edge.float()[:, 0]
        t = target.long()
        valid = t != self.ignore_index
        n = valid.sum().clamp_min(1).to(seg.dtype)
        ce = F.cross_entropy(seg, t, reduction="none", ignore_index=self.ignore_index)
        y = boundary_targets(t, self.radius, self.ignore_index)
        beta = 1.0 - (y * valid).sum() / n
        bce = beta * y * F.softplus(-edge) + (1 - beta) * (1 - y) * F.softplus(edge)
        onehot = F.one_hot(t.clamp(0, self.num_classes - 1), self.num_classes)
        onehot = onehot.permute(0, 3, 1, 2).to(seg.dtype) * valid[:, None]
        zeta = boundary_magnitude(torch.softmax(seg / self.tau, dim=1))
        zeta_gt = boundary_magnitude(onehot)
        picked = (torch.sigmoid(edge) > self.threshold) & valid
        return {"seg": (ce.sum(), n), "edge": ((bce * valid).sum(), n),
                "dual": (((zeta - zeta_gt).abs() * valid).sum(), n),
                "att": ((ce * picked).sum(), picked.sum().clamp_min(1).to(seg.dtype))}

    def combine(self, terms: Terms, norm: Tensor | None = None) -> Tensor:
        """The weighted total ``Σ λ_i sum_i / weight_i``.

        With ``norm`` (the whole image's pixel weight, grid training) the cross-entropy is
        ``sum / norm`` and the other terms are scaled by this tile's share ``weight / norm``,
        so the tiles of an image add up to one image.
        """
        seg_sum, seg_w = terms["seg"]
        share = 1.0 if norm is None else seg_w / norm.clamp_min(1e-12)
        total = self.weights["seg"] * seg_sum / (seg_w if norm is None else norm.clamp_min(1e-12))
        for k in ("edge", "dual", "att"):
            if self.weights[k]:
                s, w = terms[k]
                total = total + self.weights[k] * share * s / w
        return total

    def forward(self, seg: Tensor, edge: Tensor, target: Tensor) -> Tensor:
        """The weighted total (mean over valid pixels)."""
        return self.combine(self.terms(seg, edge, target))


def _class_boundaries(labels: Tensor, k: int, ignore: Tensor) -> Tensor:
    """Inner boundary of ``labels == k`` (a pixel of k with a 8-neighbour outside k).

    Ignored pixels count as inside (they make no boundary), and so does the outside of the
    image (replicate padding: the image border is not a boundary).
    """
    inside = ((labels == k) | ignore)[:, None].float()
    eroded = -F.max_pool2d(-F.pad(inside, (1, 1, 1, 1), mode="replicate"), 3, stride=1)
    return (labels == k) & ~ignore & (eroded[:, 0] < 0.5)


def _dilate(mask: Tensor, tolerance: int) -> Tensor:
    r = tolerance
    yy, xx = torch.meshgrid(torch.arange(-r, r + 1), torch.arange(-r, r + 1), indexing="ij")
    disk = ((yy**2 + xx**2) <= r * r).float()[None, None].to(mask.device)
    return F.conv2d(mask[:, None].float(), disk, padding=r)[:, 0] > 0.5


def boundary_f_counts(pred: Tensor, target: Tensor, num_classes: int, tolerance: int = 3,
                      ignore_index: int = 255) -> Tensor:
    """Per-class boundary match counts ``[K, 4]`` for label maps ``[B, H, W]``.

    Columns: precision hits, predicted boundary pixels, recall hits, true boundary pixels.

    A predicted boundary pixel is a hit when a true boundary pixel of the same class lies
    within ``tolerance`` pixels (Euclidean), and vice versa.
    """
    ignore = target == ignore_index
    out = torch.zeros(num_classes, 4, dtype=torch.float64)
    for k in range(num_classes):
        bp, bg = _class_boundaries(pred, k, ignore), _class_boundaries(target, k, ignore)
        if not (bp.any() or bg.any()):
            continue
        out[k, 0] = (bp & _dilate(bg, tolerance)).sum()
        out[k, 1] = bp.sum()
        out[k, 2] = (bg & _dilate(bp, tolerance)).sum()
        out[k, 3] = bg.sum()
    return out


def boundary_f_score(counts: Tensor) -> tuple[Tensor, Tensor]:
    """``(per-class F [K] (NaN where a class has no boundary), mean F over the others)``."""
    p = counts[:, 0] / counts[:, 1].clamp_min(1)
    r = counts[:, 2] / counts[:, 3].clamp_min(1)
    f = torch.where(p + r > 0, 2 * p * r / (p + r).clamp_min(1e-12), torch.zeros_like(p))
    f = torch.where((counts[:, 1] + counts[:, 3]) > 0, f, torch.full_like(f, float("nan")))
    present = ~torch.isnan(f)
    return f, f[present].mean() if present.any() else torch.tensor(0.0, dtype=f.dtype)


class GSCNNTask(SegmentationTask):
    """:class:`SegmentationTask` for Gated-SCNN: dual loss, mIoU and boundary F-score.

    Args:
        model: a :class:`seg_at_scale.models.GSCNN` (anything with ``forward_dual``).
        num_classes: K.
        loss: the :class:`GSCNNLoss` (default: the paper's terms and weights).
        boundary_tolerance: pixel tolerance of the boundary F-score (``val/boundary_f``).
        **kwargs: as for :class:`SegmentationTask`.
    """

    loss: GSCNNLoss

    def __init__(self, model: nn.Module, num_classes: int, *, loss: GSCNNLoss | None = None,
                 boundary_tolerance: int = 3, **kwargs: Any) -> None:
        if not isinstance(getattr(model, "inner", model), DualOutput):
            raise ConfigError(f"task=gscnn needs a Gated-SCNN model (with forward_dual), got "
                              f"{type(model).__name__}; use model=gscnn_<size>")
        ignore = int(kwargs.get("ignore_index", 255))
        super().__init__(model, num_classes, loss=loss or GSCNNLoss(num_classes, ignore),
                         **kwargs)
        self.boundary_tolerance = boundary_tolerance
        self._bf = torch.zeros(num_classes, 4, dtype=torch.float64)

    def forward_dual(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(seg, boundary)`` logits, channels-last when configured, through the Pipe if any.

        A pipeline carries one tensor: it needs the model built with ``output="packed"``.
        """
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        pipe = self.pipe
        if pipe is not None:
            if getattr(self.model, "output", "packed") != "packed":
                raise ConfigError("a Gated-SCNN pipeline must return the boundary too: set "
                                  "model.output=packed")
            y = pipe(x.to(pipe.devices[0]))
            return y[:, :-1], y[:, -1:]
        if isinstance(self.model, MemoryWrapped):
            # the memory mode runs the single-tensor forward: both outputs packed in it
            # (calling forward_dual would reach the unwrapped model: no mode at all)
            with self.model.inner.packed_output():
                return unpack(self.model(x))
        return cast(DualOutput, self.model).forward_dual(x)  # checked in __init__

    def on_fit_start(self) -> None:
        if uses_image_pool(self.model):
            log.warning("Gated-SCNN image pooling sees each training/validation tile's own "
                        "mean, not the whole image's: tile training and validation are an "
                        "approximation (whole-image prediction pools in a first pass and is "
                        "exact; exact gradients: seg_at_scale.tiling.tiled_backward_two_pass)")
        if any(isinstance(m, nn.BatchNorm2d) for m in self.model.modules()):
            log.warning("BatchNorm in train mode uses tile statistics: tiled training is not "
                        "exact (model.norm=none, or frozen statistics, makes it exact)")

    def tile_loss(self, batch: dict[str, Tensor]) -> Tensor:
        seg, edge = self.forward_dual(batch["image"])
        terms = self.loss.terms(seg, edge, batch["target"].to(seg.device))
        loss = self.loss.combine(terms, batch["norm"].sum().to(seg.device, seg.dtype))
        for k, (s, w) in terms.items():
            self.log(f"train/{k}", s.detach() / w, batch_size=1)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        if self.skip_pad(batch):
            return
        seg, edge = self.forward_dual(batch["image"])
        target = batch["target"].to(seg.device)
        terms = self.loss.terms(seg, edge, target)
        self.log("val/loss", self.loss.combine(terms, batch["norm"].sum().to(seg.dtype)),
                 reduce_fx="sum", on_epoch=True, batch_size=1, sync_dist=True)
        pred = seg.argmax(1)
        self.val_iou.update(pred, target)
        self._bf += boundary_f_counts(pred.cpu(), target.cpu(), self.num_classes,
                                      self.boundary_tolerance, self.ignore_index)

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        per_class, mean = boundary_f_score(self._bf)
        self.log("val/boundary_f", mean.float(), prog_bar=True)
        for name, v in zip(self.class_names, per_class):
            if not torch.isnan(v):
                self.log(f"val/boundary_f_{name}", v.float())
        self._bf.zero_()
