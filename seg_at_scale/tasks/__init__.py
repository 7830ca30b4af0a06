"""Lightning tasks and losses.

The losses import with torch alone; :class:`SegmentationTask` and :func:`poly_lr` are
imported on first use, so a process that needs a loss (a rank computing a gradient, a
memory probe) does not import Lightning.
"""

from typing import TYPE_CHECKING, Any

from seg_at_scale.tasks.losses import CrossEntropy, FocalLoss

if TYPE_CHECKING:
    from seg_at_scale.tasks.segmentation import SegmentationTask, poly_lr

__all__ = ["CrossEntropy", "FocalLoss", "SegmentationTask", "poly_lr"]


def __getattr__(name: str) -> Any:
    if name in ("SegmentationTask", "poly_lr"):
        from seg_at_scale.tasks import segmentation

        return getattr(segmentation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
