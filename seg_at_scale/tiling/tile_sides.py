"""Legal square tile sides for a model footprint: what the largest-tile search walks over.

A tile's input window is ``core + 2 * context`` with the core a multiple of the alignment
(plus the size residue for valid padding), so legal sides step by ``align`` from the
smallest window that still has one aligned block of core - the same rule
:func:`seg_at_scale.tiling.geometry.split_axis` applies to ``tile_size``.

>>> from seg_at_scale.tiling import Footprint
>>> smallest_side(Footprint(92, 16, "valid", 4)), legal_side(Footprint(92, 16, "valid", 4), 600)
(204, 588)
>>> smallest_side(Footprint(94, 16, "same")), legal_side(Footprint(94, 16, "same"), 1000)
(208, 992)
"""

from __future__ import annotations

from seg_at_scale.tiling.geometry import Footprint

__all__ = ["smallest_side", "legal_side", "core_side", "covering_side"]


def smallest_side(fp: Footprint) -> int:
    """Smallest input window with one aligned block of core."""
    residue = fp.out_residue % fp.align if fp.padding == "valid" else 0
    return 2 * fp.context + fp.align + residue


def legal_side(fp: Footprint, side: int) -> int:
    """Largest legal window side <= ``side`` (at least :func:`smallest_side`)."""
    lo = smallest_side(fp)
    return lo + max(0, (side - lo) // fp.align) * fp.align


def core_side(fp: Footprint, side: int) -> int:
    """Core (output pixels kept) of an interior tile with this window side."""
    return side - 2 * fp.context - (fp.out_residue % fp.align if fp.padding == "valid" else 0)


def covering_side(fp: Footprint, height: int, width: int) -> int:
    """The legal window side whose single tile covers an ``height x width`` image."""
    need = max(height, width) + 2 * fp.context + fp.align
    return legal_side(fp, need)
