"""The prediction store: a Zarr v3 group whose chunks are the tile cores.

Every prediction writes here first, whatever the output format: ``labels`` (uint8
``[H, W]``, 255 = no data) and optionally ``probabilities`` (``[K, H, W]``, uint8 =
round(255 p) or float16). Chunks equal the grid's uniform tile cores, so each tile is one
chunk of each array, written atomically by zarr (temporary file + rename): tiles can be
written by any process in any order, and a chunk present on disk is a finished tile. A
killed run rerun with the same command continues from the chunks already there.

The group's attributes hold the georeferencing (GDAL geotransform, CRS WKT, nodata),
the class names, ``complete`` and a *fingerprint* of everything that determines the
values (model weights, input file, tiling, precision, TTA): a store made by another run
is refused, never resumed into.

>>> import xarray  # doctest: +SKIP
>>> xarray.open_zarr("scene_mask.zarr", consolidated=False,
...                 mask_and_scale=False)["labels"]  # uint8, 255 = no data  # doctest: +SKIP
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import zarr

from seg_at_scale.errors import InputError, OutputExistsError
from seg_at_scale.metrics import NODATA
from seg_at_scale.tiling.geometry import Tile, TileGrid

if TYPE_CHECKING:
    from zarr.core.array_spec import ArrayConfigParams
    from zarr.core.chunk_key_encodings import ChunkKeyEncodingParams

__all__ = ["PredictionStore", "NODATA"]

_FORMAT = "seg_at_scale.prediction/1"


class PredictionStore:
    """Open (or create) the store of one prediction run; see the module docstring."""

    def __init__(self, path: Path, group: zarr.Group) -> None:
        self.path, self.group = path, group
        # a chunk on disk is a finished tile, also one all no data (255) or all 0: zarr's
        # write_empty_chunks is not stored with an array, so every opening sets it again
        self.labels = _every_chunk(group["labels"])  # arrays (_create)
        self.probabilities = (_every_chunk(group["probabilities"])
                              if "probabilities" in group else None)
        self._watchers: list[Callable[[], None]] = []

    def watch(self, written: Callable[[], None]) -> None:
        """Call ``written()`` after each tile this process writes is on disk (its thread)."""
        self._watchers.append(written)

    # -- creation and resume ------------------------------------------------------------

    @classmethod
    def open(cls, path: Path, grid: TileGrid, *, fingerprint: dict[str, Any],
             num_classes: int, probabilities: str | None, attrs: dict[str, Any],
             resume: bool, key: str = "output", replace: bool = False) -> PredictionStore:
        """Resume a matching store at ``path`` or create a fresh one.

        ``replace`` (``overwrite=true``): a store of another prediction there is deleted and
        begun afresh instead of refused.

        Raises:
            OutputExistsError: ``path`` holds a store of another run (the message lists
                the differing keys) or something that is not a prediction store.
        """
        if path.exists() and resume:
            store = cls._existing(path, key)
            old = cast(dict[str, Any], store.group.attrs.get("fingerprint", {}))
            keys = set(old) | set(fingerprint)
            diff = sorted(k for k in keys if not _same(old.get(k), fingerprint.get(k)))
            if not diff:
                store.clean_partials()
                return store
            if not replace:
                raise OutputExistsError(
                    f"{key}: the store '{path}' was made by another prediction (differs in: "
                    f"{', '.join(diff)}); rerun with resume=false or overwrite=true to start "
                    "afresh (it is deleted), or choose another output")
        if path.exists():
            cls._existing(path, key)  # refuse to delete what is not a prediction store
            shutil.rmtree(path)
        return cls._create(path, grid, fingerprint, num_classes, probabilities, attrs)

    @classmethod
    def attach(cls, path: Path, key: str = "output") -> PredictionStore:
        """Open an existing prediction store (another rank created it)."""
        return cls._existing(path, key)

    @classmethod
    def _existing(cls, path: Path, key: str) -> PredictionStore:
        try:
            group = zarr.open_group(path, mode="r+")
            if group.attrs.get("format") != _FORMAT:
                raise ValueError("not a prediction store")
            return cls(path, group)
        except (ValueError, KeyError, FileNotFoundError, zarr.errors.NodeTypeValidationError
                ) as exc:
            raise OutputExistsError(
                f"{key}: '{path}' exists and is not a seg_at_scale prediction store ({exc}); "
                "choose another output path or remove it yourself") from exc

    @classmethod
    def _create(cls, path: Path, grid: TileGrid, fingerprint: dict[str, Any],
                num_classes: int, probabilities: str | None, attrs: dict[str, Any]
                ) -> PredictionStore:
        chunk = (grid.tiles[0].core.height, grid.tiles[0].core.width)
        group = zarr.open_group(path, mode="w", zarr_format=3)
        config: ArrayConfigParams = {"write_empty_chunks": True}  # on disk <=> a finished tile
        enc: ChunkKeyEncodingParams = {"name": "default", "separator": "/"}
        group.create_array("labels", shape=(grid.height, grid.width), dtype="uint8",
                           chunks=chunk, fill_value=NODATA, dimension_names=("y", "x"),
                           config=config, chunk_key_encoding=enc,
                           attributes={"grid_mapping": "spatial_ref", "_FillValue": NODATA})
        if probabilities is not None:
            if probabilities not in ("uint8", "float16"):
                raise InputError(f"probabilities={probabilities!r}: use uint8, float16 or null")
            group.create_array("probabilities", shape=(num_classes, grid.height, grid.width),
                               dtype=probabilities, chunks=(num_classes, *chunk),
                               fill_value=0, dimension_names=("class", "y", "x"),
                               config=config, chunk_key_encoding=enc,
                               attributes={"grid_mapping": "spatial_ref",
                                           "scale": 1 / 255 if probabilities == "uint8" else 1})
        _coordinates(group, grid, attrs)
        group.attrs.update({**attrs, "format": _FORMAT, "fingerprint": fingerprint,
                            "complete": False, "chunk": list(chunk)})
        return cls(path, group)

    # -- tiles --------------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        return bool(self.group.attrs.get("complete", False))

    def arrays(self) -> list[zarr.Array]:
        return [a for a in (self.labels, self.probabilities) if a is not None]

    @property
    def chunk(self) -> tuple[int, int]:
        """Rows and columns of a chunk: a tile's core (``_create``)."""
        ch, cw = cast(list[int], self.group.attrs["chunk"])
        return ch, cw

    def chunk_index(self, tile: Tile) -> tuple[int, int]:
        ch, cw = self.chunk
        if tile.core.row % ch or tile.core.col % cw:
            raise ValueError(f"tile core {tile.core} is not on the store's {ch}x{cw} chunks")
        return tile.core.row // ch, tile.core.col // cw

    def done(self, tile: Tile) -> bool:
        """Whether every array holds the tile's chunk (zarr renames chunks into place)."""
        i, j = self.chunk_index(tile)
        return all(self._chunk_file(a, i, j).exists() for a in self.arrays())

    def _chunk_file(self, array: zarr.Array, i: int, j: int) -> Path:
        parts = ["c"] + (["0"] if array.ndim == 3 else []) + [str(i), str(j)]
        return self.path / array.basename / Path(*parts)

    def write(self, tile: Tile, labels: np.ndarray, probabilities: np.ndarray | None) -> None:
        """Write one tile's core (labels ``[h, w]``, probabilities ``[K, h, w]``)."""
        rows, cols = tile.core.slices()
        if self.probabilities is not None:
            assert probabilities is not None
            self.probabilities[:, rows, cols] = probabilities  # labels last: they mark done
        self.labels[rows, cols] = labels
        for written in self._watchers:
            written()

    def clean_partials(self) -> int:
        """Remove temporary chunk files left by a killed writer; returns how many."""
        n = 0
        for p in self.path.rglob("*.partial"):
            p.unlink(missing_ok=True)
            n += 1
        return n

    def row_bands(self, array: zarr.Array,
                  ready: Callable[[int], None] | None = None) -> Iterator[np.ndarray]:
        """The array top to bottom, one chunk row at a time (``[..., h, W]``).

        ``ready(i)``, when given, is called before chunk row ``i`` is read: it returns once
        that row is on disk (a finalisation beside the tile writer).
        """
        ch = self.chunk[0]
        height = array.shape[-2]
        for i, r in enumerate(range(0, height, ch)):
            if ready is not None:
                ready(i)
            yield cast(np.ndarray, array[..., r : min(r + ch, height), :])  # numpy-backed

    def finish(self, class_pixels: Sequence[int]) -> None:
        self.group.attrs.update({"complete": True, "class_pixels": list(class_pixels)})


def _every_chunk(node: Any) -> zarr.Array:
    """The array, writing every chunk it is given (zarr skips chunks of its fill value)."""
    return cast(zarr.Array, node).with_config({"write_empty_chunks": True})


def _coordinates(group: zarr.Group, grid: TileGrid, attrs: dict[str, Any]) -> None:
    """``x`` / ``y`` pixel-centre coordinates and a CF ``spatial_ref`` (as rioxarray writes).

    Written only for georeferenced inputs (a north-up GDAL geotransform in ``attrs``).
    """
    gt = attrs.get("geotransform")
    if not gt:
        return
    x0, dx, _, y0, _, dy = gt
    for name, n, o, d in (("x", grid.width, x0, dx), ("y", grid.height, y0, dy)):
        arr = group.create_array(name, shape=(n,), dtype="float64", chunks=(n,),
                                 dimension_names=(name,))
        arr[:] = o + d * (np.arange(n) + 0.5)
    ref = group.create_array("spatial_ref", shape=(), dtype="int32", fill_value=0,
                             attributes={"crs_wkt": attrs.get("crs_wkt", ""),
                                         "spatial_ref": attrs.get("crs_wkt", ""),
                                         "GeoTransform": " ".join(repr(float(v)) for v in gt)})
    ref[...] = 0


def _same(a: Any, b: Any) -> bool:
    """Equal fingerprint values, NaN equal to NaN (``nodata=nan`` never equals itself)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)
