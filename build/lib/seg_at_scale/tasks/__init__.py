"""Lightning tasks and losses."""

from seg_at_scale.tasks.losses import CrossEntropy, FocalLoss
from seg_at_scale.tasks.segmentation import SegmentationTask, poly_lr

__all__ = ["CrossEntropy", "FocalLoss", "SegmentationTask", "poly_lr"]
