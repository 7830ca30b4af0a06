"""Every check a prediction can make before its first tile, in one place.

A check that lives beside the code it guards runs when that code is reached: a mask with
a label >= num_classes failed after the whole prediction, an output that is a folder after
every tile, a NaN image after 47 of 48 tiles. :func:`check_scene` runs them all from the
files' headers (and one streamed pass over a ground-truth mask), needs no torch
computation, and so runs in the launching process before any rank is forked:

* outputs against inputs: no output may be an input (the image, the mask, the model's
  files), whatever the path says (``./``, symlinks, hard links), and no input may lie
  inside an output folder — ``output=gt.tif mask=gt.tif overwrite=true`` replaced the
  ground truth with the prediction and scored 1.0;
* outputs against the file system: a ``.tif`` output that is a folder, a ``.zarr`` that
  is a plain file, an existing output without ``overwrite``;
* the image: its size, bands against the model, its sample type against the training
  data's (a uint16 or float image through a uint8 model changed 28-78 % of the labels),
  a ``nodata`` value its type cannot hold;
* the mask: its size, band count, label values against the model's classes;
* the grid: enough batches for the ranks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from seg_at_scale.data.scenes import check_mask_covers, class_histogram
from seg_at_scale.errors import ConfigError, InputError, OutputExistsError
from seg_at_scale.io import RasterReader
from seg_at_scale.io.raster import is_tiff, raster_files
from seg_at_scale.models.card import ModelCard
from seg_at_scale.prediction.options import PredictOptions, default_batch_size
from seg_at_scale.prediction.outputs import output_kind
from seg_at_scale.tiling import make_grid
from seg_at_scale.tiling.engine import count_batches, plan_batches
from seg_at_scale.tiling.geometry import Footprint, cover_axis, split_axis
from seg_at_scale.tiling.tile_sides import smallest_side

__all__ = ["SceneCheck", "check_scene", "check_outputs", "same_path", "scene_outputs",
           "preview_path", "probabilities_path", "store_path", "claim_path", "check_dtype",
           "check_nodata_fits", "DTYPE_HIGH_RATIO", "rewritten_by_resume", "not_ours",
           "companion_is_ours"]

DTYPE_HIGH_RATIO = 4.0  # a float image whose typical high is 4x off the training data's


@dataclass(frozen=True)
class SceneCheck:
    """What the checks found: the image's size and type, the grid's tiles and batches.

    ``tiles`` and ``batches`` are None for ``tile_size=auto``, chosen later with the network.
    """

    height: int
    width: int
    dtype: str
    tiles: int | None
    batches: int | None


def preview_path(output: Path) -> Path:
    """The PNG drawn beside a prediction (``scene.v1.tif`` -> ``scene.v1_preview.png``)."""
    return output.with_name(f"{output.stem}_preview.png")


def probabilities_path(output: Path) -> Path:
    """A ``.tif`` output's softmax COG, ``NAME_probabilities.tif``."""
    return output.with_name(f"{output.stem}_probabilities{output.suffix}")


def store_path(output: Path) -> Path:
    """The working Zarr store, hidden beside the output until it is complete.

    ``scene.tif`` -> ``.scene.tif.zarr``, from which the COG is written; ``scene.zarr`` ->
    ``.scene.zarr``, renamed to ``scene.zarr`` once complete (:func:`~.finalize.finalize`):
    nothing under the output's name is ever a store that a killed run left unfinished.
    """
    return output.with_name(f".{output.name}" if output.suffix.lower() == ".zarr"
                            else f".{output.name}.zarr")


def claim_path(output: Path) -> Path:
    """The file whose creation elects the one rank that finalises an archive's scene."""
    return output.with_name(f".{output.name}.claim")


def scene_outputs(output: Path, options: PredictOptions,
                  vector: Path | None = None) -> dict[str, Path]:
    """Every path a prediction of one scene writes, by the key users know it by."""
    outs = {"output": output, "working store": store_path(output)}
    if output.suffix.lower() != ".zarr" and options.probabilities:
        outs["probabilities"] = probabilities_path(output)
    if options.preview:
        outs["preview"] = preview_path(output)
    if vector is not None:
        outs["vector"] = vector
    if options.stac:
        from seg_at_scale.catalog.items import item_path

        outs["stac"] = item_path(output)
    return outs


COMPANIONS = ("probabilities", "preview", "vector", "stac")  # written after the output


def rewritten_by_resume(key: str, output: Path) -> bool:
    """Whether an existing ``key`` file of ``output`` is a killed finaliser's, not another's.

    The finaliser writes a ``.tif`` output's probabilities before its labels; killed between
    the two, it leaves them beside the working store, which the rerun resumes (or refuses by
    its fingerprint) and finalises again, rewriting them.
    """
    return key == "probabilities" and output.suffix.lower() != ".zarr" and \
        (store_path(output) / "zarr.json").is_file()


def not_ours(key: str, path: Path, output: Path) -> str:
    """Why an existing companion is refused: the prediction at ``output`` did not write it.

    A file of the user's, or one changed since it was written.
    """
    return (f"{key} '{path}' already exists and was not written by the prediction of "
            f"'{output}'; pass overwrite=true to replace it (or choose another path)")


def companion_is_ours(key: str, path: Path, output: Path) -> bool:
    """Whether companion ``key`` at ``path`` may be kept or rewritten without ``overwrite``.

    True when it is missing, or was written by the prediction finished at ``output`` and is
    unchanged since.
    """
    from seg_at_scale.prediction.provenance import owner_of, written_by

    if not path.exists():
        return True
    mine = owner_of(output)
    return mine is not None and written_by(key, path) == mine


def _check_writable(key: str, out: Path) -> None:
    """Refuse an output whose folder (or the nearest one there is) cannot be written.

    Found before any tile: a read-only folder given for the polygons ended the run after
    the labels were written, in a message about training paths.
    """
    folder = Path(os.path.abspath(out)).parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}='{out}': the folder '{folder}' is not writable; choose a "
                          "writable location")


def same_path(a: Path, b: Path) -> bool:
    """Whether two paths name one file: after ``./``, ``..`` and symlinks, or hard links."""
    if Path(os.path.realpath(a)) == Path(os.path.realpath(b)):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _inside(inner: Path, folder: Path) -> bool:
    return Path(os.path.realpath(folder)) in Path(os.path.realpath(inner)).parents


def check_outputs(outputs: Mapping[str, Path], inputs: Mapping[str, Path], *,
                  overwrite: bool) -> None:
    """Refuse outputs that are inputs, folders where files go, or exist (see module doc).

    An output that is a finished seg_at_scale prediction may exist: the rank that opens it
    reuses it if this very prediction made it, and refuses it otherwise
    (:mod:`seg_at_scale.prediction.provenance`). Its companions may exist only if the
    prediction finished there wrote them, unchanged since (:func:`companion_is_ours`): a
    rerun keeps or rewrites those, and would replace anything else.
    """
    from seg_at_scale.prediction.provenance import finished, owner, written_by

    for okey, out in outputs.items():
        for ikey, inp in inputs.items():
            if same_path(out, inp) or _inside(inp, out):
                raise ConfigError(f"{okey} '{out}' is the {ikey} '{inp}' (or holds it): "
                                  "writing it would destroy an input; choose another output "
                                  "path")
        _check_writable(okey, out)
        zarr = out.suffix.lower() == ".zarr"
        if zarr and out.exists() and not out.is_dir():
            raise ConfigError(f"{okey} '{out}' is a plain file, not a Zarr store; remove it or "
                              "choose another path")
        if not zarr and out.is_dir():
            raise ConfigError(f"{okey} '{out}' is a folder; a file is written there, and "
                              "folders are never replaced: remove it or choose another path")
    if overwrite or "output" not in outputs:
        return
    done = finished(outputs["output"])
    for key in ("output", *COMPANIONS):
        path = outputs.get(key)
        if path is None or not path.exists():
            continue
        if done is not None:  # the output: reused, or refused as another prediction's
            if key in ("output", "probabilities") or \
                    written_by(key, path) == owner(done[0], outputs["output"]):
                continue  # made with the output (never rewritten on reuse), or ours
            raise OutputExistsError(not_ours(key, path, outputs["output"]))
        if rewritten_by_resume(key, outputs["output"]):
            continue
        raise OutputExistsError(f"{key} '{path}' already exists; pass overwrite=true "
                                "to replace it (or choose another path)")


def check_nodata_fits(nodata: float | None, dtype: np.dtype, image: Path) -> None:
    """Refuse a ``nodata`` value the image's sample type cannot hold (it would mask nothing)."""
    if nodata is None or np.isnan(nodata) or not np.issubdtype(dtype, np.integer):
        if nodata is not None and np.isnan(nodata) and np.issubdtype(dtype, np.integer):
            raise ConfigError(f"nodata=nan but image '{image}' has integer samples ({dtype}), "
                              "which are never NaN; give the value that marks no data")
        return
    info = np.iinfo(dtype)
    if nodata != int(nodata) or not info.min <= nodata <= info.max:
        raise ConfigError(f"nodata={nodata:g} cannot occur in image '{image}' ({dtype}, "
                          f"{info.min}..{info.max}): it would mark no pixel; give a value "
                          "of that range")


def check_dtype(reader: RasterReader, trained: Mapping[str, Any], source: str, *,
                strict: bool = True) -> None:
    """Refuse an image whose samples are not the kind the model was trained on.

    ``trained`` is the card's ``data.input`` (``dtype``, ``high``: the training sample's
    largest band mean + 3 std, raw units). A float image of the training dtype is also
    sampled, and refused when its typical high is :data:`DTYPE_HIGH_RATIO` x off.
    Boolean and complex samples are refused always; the rest only when ``strict``
    (``check_dtype=false`` vouches for the values).
    """
    kind = reader.dtype.kind
    if kind in "cbV":
        raise InputError(f"image '{reader.path}' has {reader.dtype} samples, which no model "
                         "reads; convert it to the training data's type")
    want = trained.get("dtype")
    if not want or not strict:
        return
    fix = ("rescale the image to the training data's type and range, or pass "
           "check_dtype=false if its values already match what the model was trained on")
    if np.dtype(want) != reader.dtype:
        raise InputError(f"image '{reader.path}' has {reader.dtype} samples but {source} was "
                         f"trained on {want} imagery, whose normalisation would map these "
                         f"values elsewhere; {fix}")
    high = trained.get("high")
    if kind == "f" and high:
        from seg_at_scale.data.band_stats import sample_sums

        mean, std = sample_sums(reader).mean_std()
        now = float(np.max(mean + 3 * std))
        if not high / DTYPE_HIGH_RATIO <= now <= high * DTYPE_HIGH_RATIO:
            raise InputError(f"image '{reader.path}' reaches about {now:.4g} (mean + 3 std) "
                             f"but {source} was trained on {want} imagery reaching about "
                             f"{high:.4g}; {fix}")


def check_scene(image: Path, output: Path, options: PredictOptions, *, card: ModelCard,
                source: str, model_files: Mapping[str, Path], mask: Path | None = None,
                ranks: int = 1, cuda: bool = False, vector: Path | None = None) -> SceneCheck:
    """All checks of one scene before any tile (see the module docstring).

    Args:
        image: the input raster.
        output: ``.tif`` (COG) or ``.zarr``.
        options: the prediction's options.
        card: the model's card (:class:`~seg_at_scale.models.trained.TrainedModel`).
        source: the model, for messages (``run 'runs/x'``).
        model_files: the model's files (run config, checkpoint; or the model file).
        mask: optional ground truth to score against.
        ranks: processes that will share the grid's batches.
        cuda: whether the model runs on a GPU (the default batch size).
        vector: a vector output (``.gpkg``, ``.parquet``, ``.fgb``) of the labels' polygons.
    """
    output_kind(output)
    if not image.is_file():
        raise InputError(f"image='{image}' does not exist; give the path of a raster to "
                         "predict" if not image.exists() else f"image='{image}' is a folder; "
                         "give a raster file (images=<folder> predicts every raster in it)"
                         if image.is_dir() else f"image='{image}' is not a file (a device or "
                         "a pipe); give the path of a raster file")
    card.normalizer(source)  # a std or scale that is not > 0
    if card.planes > 1:  # one label raster would hold plane x class ids
        raise InputError(
            f"{source} labels {card.planes} detector planes apart ({card.num_classes} classes "
            f"each, {card.planes * card.num_classes} logit channels), and seg-predict writes "
            "one label per pixel of an image; predict its events in Python with "
            f"predict_tiled, then plane_view(logits, {card.planes}).argmax(1) "
            "(docs/models.md)")
    inputs = {"image": image, **model_files, **({"mask": mask} if mask is not None else {})}
    # the files GDAL reads the image from (a VRT mosaic's pieces): no output replaces them,
    # and a TIFF among them that is truncated is named now, not when a tile reaches it
    pieces = raster_files(image)[1:]
    inputs |= {f"image's file {k}": f for k, f in enumerate(pieces, 1)}
    for piece in pieces:
        if piece.suffix.lower() in (".tif", ".tiff") and is_tiff(piece):
            RasterReader(piece).close()
    if vector is not None:
        from seg_at_scale.vectors.polygonize import check_options
        from seg_at_scale.vectors.write import vector_format

        vector_format(vector, "vector")
        check_options(options.vector_connectivity, options.vector_classes, None)
        beyond = sorted(c for c in options.vector_classes or () if c >= card.num_classes)
        if beyond:  # polygons of a class the model never predicts: an empty file
            raise ConfigError(f"vector_classes={list(options.vector_classes or ())} holds "
                              f"{beyond}, but {source} predicts classes 0..{card.num_classes - 1}"
                              f" ({', '.join(card.class_names)}); give ids among them")
    check_outputs(scene_outputs(output, options, vector), inputs, overwrite=options.overwrite)
    with RasterReader(image, nodata=options.nodata) as reader:
        if reader.height == 0 or reader.width == 0:
            raise InputError(f"image '{image}' is {reader.height}x{reader.width} pixels: "
                             "there is nothing to predict; give a non-empty raster")
        if reader.bands != card.bands:
            raise InputError(f"image '{image}' has {reader.bands} bands but {source} was "
                             f"trained on {card.bands}; predict an image with "
                             f"{card.bands} bands")
        check_nodata_fits(options.nodata, reader.dtype, image)
        check_dtype(reader, card.input, source, strict=options.check_dtype)
        if mask is not None:
            _check_mask(mask, reader, card.num_classes, card.ignore_index)
        fp = card.footprint
        if options.tile_size == "auto" and options.q is None:  # chosen with the network
            most = most_batches(reader.height, reader.width, fp, options.batch_size)
            if ranks > most:  # whatever tile the network is given
                raise too_many_ranks(ranks, image, most, None, most)
            return SceneCheck(reader.height, reader.width, str(reader.dtype), None, None)
        tile = None if options.tile_size == "auto" else options.tile_size  # q wins
        grid = make_grid(reader.height, reader.width, fp, q=options.q, tile_size=tile,
                         uniform=True)
        batch = options.batch_size or default_batch_size(grid, "cuda" if cuda else "cpu")
        batches = plan_batches(grid.tiles, batch)
        if ranks > len(batches):
            raise too_many_ranks(ranks, image, len(batches), len(grid),
                                 most_batches(reader.height, reader.width, fp, batch))
        return SceneCheck(reader.height, reader.width, str(reader.dtype), len(grid),
                          len(batches))


def most_batches(height: int, width: int, fp: Footprint, batch_size: int | None) -> int:
    """The most batches any grid of a ``height x width`` image has: the smallest tiles'.

    Counted from the two axes' splits by :func:`~seg_at_scale.tiling.engine.count_batches`,
    the rule :func:`~seg_at_scale.tiling.engine.plan_batches` groups the grid's tiles by
    (runs of one input size in row-major order), without making the grid: the smallest
    tiles of a network with a few pixels of halo number millions on a large scene (8192^2:
    minutes and 12 GB before any work, for every seg-predict).
    """
    side = smallest_side(fp)

    def reads(length: int) -> list[tuple[int, int]]:  # (read length, tiles): runs in order
        runs: list[tuple[int, int]] = []
        for lo, hi, _, _ in split_axis(length, fp, tile=side, uniform=True):
            r0, r1, _ = cover_axis(lo, hi, length, fp)
            if runs and runs[-1][0] == r1 - r0:
                runs[-1] = (r1 - r0, runs[-1][1] + 1)
            else:
                runs.append((r1 - r0, 1))
        return runs

    cols = reads(width)  # every row of tiles has the same runs of columns, row-major order
    return count_batches((((rh, cw), n) for rh, rows in reads(height) for _ in range(rows)
                          for cw, n in cols), batch_size or 1)


def too_many_ranks(ranks: int, image: Path, batches: int, tiles: int | None,
                   most: int) -> ConfigError:
    """More processes than the image's grid has batches: what to give instead."""
    def n(count: int, what: str) -> str:
        return f"{count} {what}{'' if count == 1 else ('es' if what == 'batch' else 's')}"

    if tiles is None:
        return ConfigError(f"processes={ranks} but no grid of '{image}' has more than "
                           f"{n(most, 'batch')} of tiles for this model (its smallest tiles); "
                           f"use processes <= {most}")
    smaller = ", or smaller tiles (tile_size or q)" if most > batches else ""
    return ConfigError(f"processes={ranks} but the grid of '{image}' has only "
                       f"{n(batches, 'batch')} of tiles ({n(tiles, 'tile')}); use "
                       f"processes <= {batches}{smaller}")


def _check_mask(mask: Path, image: RasterReader, num_classes: int, ignore_index: int) -> None:
    if not mask.is_file():
        raise InputError(f"mask='{mask}' does not exist; give the ground-truth raster or drop "
                         "mask=")
    with RasterReader(mask) as m:
        check_mask_covers(m, image)
        class_histogram(m, num_classes, ignore_index, model=True)  # bands, integer, labels
