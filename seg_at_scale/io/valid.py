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

    A pixel is no-data when all its bands equal the reader's nodata value (NaN allowed) or
    GDAL's internal mask band marks it (COGs, JPEG-compressed files); the mask is None when
    there is none. NaN in a float image without a nodata value is
    refused: it would silently poison the model's output.
    """
    raw = reader.read(window, fill=fill)
    keep = reader.read_mask(window, fill=fill)  # GDAL's internal mask: False = no data
    masked = None if keep is None or keep.all() else ~keep
    if reader.nodata is not None:
        nd = reader.nodata
        bad = np.isnan(raw) if np.isnan(nd) else raw == nd
        if bad.any():
            masked = bad.all(axis=0) if masked is None else masked | bad.all(axis=0)
            raw = np.where(bad, 0, raw)
    if masked is not None:
        raw = np.where(masked, 0, raw)  # like nodata samples: zero before normalising
    if reader.nodata is not None:
        return raw, masked
    if reader.is_float and np.isnan(raw).any():
        raise InputError(
            f"'{reader.path}' has NaN pixels in rows {window.row}..{window.row_end} and no "
            "nodata value; set one (seg-predict: nodata=<value>; training: data.nodata=<value>,"
            " e.g. nan) so those pixels are masked, or clean the file")
    return raw, masked
