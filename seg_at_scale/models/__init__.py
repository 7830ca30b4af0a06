"""Segmentation networks."""

from seg_at_scale.models.unet import UNET_SIZES, UNet, UNetSize
from seg_at_scale.models.uresnet import URESNET_SIZES, UResNet, UResNetSize

__all__ = ["GSCNN", "GSCNNSize", "GSCNN_SIZES", "SMPModel",
           "UNet", "UNetSize", "UNET_SIZES", "UResNet", "UResNetSize", "URESNET_SIZES"]

#: names whose modules import torchvision, smp or timm (seconds): imported on first use
_LAZY = {"SMPModel": "seg_at_scale.models.smp", "GSCNN": "seg_at_scale.models.gscnn",
         "GSCNN_SIZES": "seg_at_scale.models.gscnn", "GSCNNSize": "seg_at_scale.models.gscnn"}


def __getattr__(name: str) -> object:
    """The Gated-SCNN and smp names on first use (PEP 562)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
