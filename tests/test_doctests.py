"""The ``>>>`` examples in the docstrings are part of the documentation: keep them true."""

import doctest
import importlib

import pytest

MODULES = [
    "seg_at_scale.tiling.geometry",
    "seg_at_scale.tiling.halo",
    "seg_at_scale.tiling.predict",
    "seg_at_scale.models.unet",
    "seg_at_scale.io.geotags",
    "seg_at_scale.io.raster",
    "seg_at_scale.io.segments",
    "seg_at_scale.data.synthetic",
    "seg_at_scale.data.scenes",
    "seg_at_scale.data.config",
    "seg_at_scale.data.band_stats",
    "seg_at_scale.parallel.sampling",
    "seg_at_scale.cli.runs",
    "seg_at_scale.memory.levels",
    "seg_at_scale.memory.modes",
    "seg_at_scale.memory.segments",
    "seg_at_scale.memory.strips",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
