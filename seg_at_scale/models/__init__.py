"""Segmentation networks."""

from seg_at_scale.models.gscnn import GSCNN, GSCNN_SIZES, GSCNNSize
from seg_at_scale.models.unet import UNET_SIZES, UNet, UNetSize
from seg_at_scale.models.uresnet import URESNET_SIZES, UResNet, UResNetSize

__all__ = ["GSCNN", "GSCNNSize", "GSCNN_SIZES", "SMPModel",
           "UNet", "UNetSize", "UNET_SIZES", "UResNet", "UResNetSize", "URESNET_SIZES"]


def __getattr__(name: str) -> object:
    """``SMPModel`` on first use: smp and timm take seconds to import."""
    if name == "SMPModel":
        from seg_at_scale.models.smp import SMPModel

        return SMPModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
