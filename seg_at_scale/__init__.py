"""seg_at_scale: exact halo-tiled semantic segmentation of very large images."""

__version__ = "0.1.0"
