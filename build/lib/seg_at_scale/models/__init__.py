"""Segmentation networks."""

from seg_at_scale.models.gscnn import GSCNN, GSCNN_SIZES, GSCNNSize
from seg_at_scale.models.unet import UNET_SIZES, UNet, UNetSize
from seg_at_scale.models.uresnet import URESNET_SIZES, UResNet, UResNetSize

__all__ = ["GSCNN", "GSCNNSize", "GSCNN_SIZES",
           "UNet", "UNetSize", "UNET_SIZES", "UResNet", "UResNetSize", "URESNET_SIZES"]
