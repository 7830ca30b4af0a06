"""Raw windows with their no-data pixels found and zeroed (the rule every reader shares)."""

from __future__ import annotations

import numpy as np

from seg_at_scale.errors import InputError
from seg_at_scale.io.raster import RasterReader
from seg_at_scale.tiling.geometry import Fill, Window

__all__ = ["read_valid"]


def read_valid(reader: RasterReader, window: Window, fill: Fill
               ) -> tuple[np.ndarray, np.ndarray | None]:
    """Raw window ``[C, h, w]`` with no-data samples zeroed, and its no-data mask ``[h, w]``.

    A pixel is no-data when all its bands equal the reader's nodata value (NaN allowed);
    the mask is None when there is none. NaN in a float image without a nodata value is
    refused: it would silently poison the model's output.
    """
    raw = reader.read(window, fill=fill)
    if reader.nodata is not None:
        nd = reader.nodata
        bad = np.isnan(raw) if np.isnan(nd) else raw == nd
        if not bad.any():
            return raw, None
        return np.where(bad, 0, raw), bad.all(axis=0)
    if reader.is_float and np.isnan(raw).any():
        raise InputError(
            f"'{reader.path}' has NaN pixels in rows {window.row}..{window.row_end} and no "
            "nodata value; set one (seg-predict: nodata=<value>; training: data.nodata=<value>,"
            " e.g. nan) so those pixels are masked, or clean the file")
    return raw, None
