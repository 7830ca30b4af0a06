"""What an output path names: its format, read from the extension (no torch needed).

The entry point checks ``output=`` with it before it takes the output's lock (whose name is
made from the output's), so ``output=.`` is refused like ``output=labels`` is.
"""

from __future__ import annotations

from pathlib import Path

from seg_at_scale.errors import ConfigError

__all__ = ["output_kind"]


def output_kind(path: Path) -> str:
    """``"zarr"`` or ``"cog"`` from the output's extension; anything else is refused."""
    suffix = path.suffix.lower()
    if path.name and suffix == ".zarr":
        return "zarr"
    if path.name and suffix in (".tif", ".tiff"):
        return "cog"
    raise ConfigError(f"output='{path}': the extension {suffix or '(none)'!r} names no format "
                      "this writes; use .tif (Cloud-Optimized GeoTIFF) or .zarr (Zarr v3)")
