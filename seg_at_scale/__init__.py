"""seg_at_scale: exact halo-tiled semantic segmentation of very large images.

Importing the package changes nothing outside it: the entry points (:mod:`seg_at_scale.cli`)
set the process's environment and register the configs' resolvers.
"""

__version__ = "0.1.0"
