"""Segmentation networks."""

from seg_at_scale.models.unet import UNET_SIZES, UNet, UNetSize

__all__ = ["UNet", "UNetSize", "UNET_SIZES"]
