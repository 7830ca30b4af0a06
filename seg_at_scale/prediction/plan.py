"""What predicting one raster involves, worked out before any tile: grid, batches, fingerprint.

:func:`plan_raster` is shared by the one-raster path (:func:`~.raster.predict_raster`) and
the archive's global work queue (:mod:`.archive`): both walk the same grid in the same
batches and fingerprint the same values, so a scene predicted in an archive is
byte-identical to the same scene predicted alone, with any number of processes.

The fingerprint names the input by the hash of its bytes (:func:`input_id`), not its path,
size or modification time: a scene replaced by other pixels of the same size, its mtime
set back, was taken for the old one (its finished output reused, its store resumed).
"""

from __future__ import annotations

import hashlib
import os
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.errors import InputError, OutputExistsError
from seg_at_scale.io import RasterReader
from seg_at_scale.io.geotags import open_dataset
from seg_at_scale.io.raster import raster_files
from seg_at_scale.io.writer import discard, remove_stale_temporaries
from seg_at_scale.models.fold import fold_batchnorm
from seg_at_scale.prediction.checks import claim_path, rewritten_by_resume, store_path
from seg_at_scale.prediction.finalize import cog_outputs
from seg_at_scale.prediction.options import PredictOptions, default_batch_size
from seg_at_scale.prediction.outputs import output_kind
from seg_at_scale.prediction.provenance import (
    canonical,
    digest,
    file_blake3,
    file_sha256,
    finished,
    recorded_fingerprint,
)
from seg_at_scale.prediction.store import NODATA, PredictionStore
from seg_at_scale.tiling import Footprint, TileGrid, make_grid
from seg_at_scale.tiling.auto_tile import auto_side
from seg_at_scale.tiling.engine import Batch, plan_batches
from seg_at_scale.tiling.tile_sides import legal_side, smallest_side

__all__ = ["RasterPlan", "plan_raster", "model_digest", "prediction_network", "reusable",
           "drop_working_store", "open_store", "input_id", "readable_input_id", "with_tile",
           "output_channels"]


def model_digest(model: nn.Module) -> str:
    """SHA-256 of the model's weights and buffers (what the store's fingerprint names)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        x = t.detach().cpu()
        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.view(torch.int16)  # same bytes; numpy has no bfloat16
        h.update(x.numpy().tobytes())  # C order, whatever the memory format
    return h.hexdigest()


def prediction_network(model: nn.Module, options: PredictOptions, bands: int,
                       fp: Footprint, num_classes: int | None = None) -> nn.Module:
    """The network a prediction runs: ``model``, its BatchNorms folded unless ``fold_bn=false``.

    The pairs are found on one small forward (:func:`~seg_at_scale.models.fold.fold_batchnorm`)
    of ``bands`` zero bands, a multiple of the footprint's alignment on a side; ``model``
    itself is unchanged. With ``num_classes``, a network that gives another number of
    channels per pixel is refused first (one label of those classes is written per pixel).
    """
    net = model
    if options.fold_bn:
        p = next(model.parameters())
        side = fp.align * max(1, -(-64 // fp.align))
        fmt = torch.channels_last if options.channels_last else torch.contiguous_format
        x = torch.zeros(1, bands, side, side, device=p.device).contiguous(memory_format=fmt)
        net = fold_batchnorm(model, x)[0]
    if num_classes is not None:
        check_classes(net, bands, fp, num_classes)  # the network that runs
    return net


def check_classes(model: nn.Module, bands: int, fp: Footprint, num_classes: int) -> None:
    """Refuse a network whose output is not one channel per class (on one smallest window).

    Argmax over other channels writes ids that are no class: a network of detector planes
    gave plane-and-class ids, a Gated-SCNN packed with its boundary gave the id K.
    """
    channels = output_channels(model, bands, fp)
    if channels != num_classes:
        raise InputError(f"the network gives {channels} channels per pixel for its "
                         f"{num_classes} classes; a prediction writes one class id per pixel "
                         "of one channel per class: rebuild the model as it predicts (a "
                         "Gated-SCNN with model.output=seg) or predict it in Python")


#: the channels each network gives per pixel, by (device, bands, its parameters' shapes: a
#: head replaced in place is asked again): asked once, not once per scene of an archive
_CHANNELS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], int]] = \
    weakref.WeakKeyDictionary()


def output_channels(model: nn.Module, bands: int, fp: Footprint) -> int:
    """The channels the network gives per pixel, from one forward on its smallest window.

    Asked once per network, device and bands (an archive's scenes share the answer).

    Raises:
        InputError: the network cannot run on ``bands`` bands (torch's words named).
    """
    p = next(model.parameters())
    known = _CHANNELS.setdefault(model, {})
    key = (str(p.device), bands, tuple(tuple(q.shape) for q in model.parameters()))
    if key not in known:
        known[key] = _channels(model, bands, smallest_side(fp), p.device)
    return known[key]


def _channels(model: nn.Module, bands: int, side: int, device: torch.device) -> int:
    with torch.inference_mode():
        try:
            return int(model(torch.zeros(1, bands, side, side, device=device)).shape[1])
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:  # torch's words for a first layer of other bands
            raise InputError(f"the network cannot run on the image's {bands} bands ("
                             f"{str(exc).splitlines()[0]}); give an image of the bands it "
                             "was trained on") from None


def with_tile(options: PredictOptions, model: nn.Module, fp: Footprint, bands: int,
              height: int, width: int, processes: int = 1) -> PredictOptions:
    """``options`` with ``tile_size=auto`` made a side for this network, device and image.

    The largest tile the device's memory holds (:mod:`seg_at_scale.tiling.auto_tile`), or
    the whole image as one tile; one tile per forward unless ``batch_size`` is given; with
    several processes, a side small enough that each has a batch. Anything else is
    returned as it is.
    """
    if options.tile_size != "auto" or options.q is not None:
        return options
    device = next(model.parameters()).device
    batch = options.batch_size or 1
    local = 1 if device.type == "cuda" else int(os.environ.get("LOCAL_WORLD_SIZE", processes))
    side = auto_side(model, fp, height, width, bands, autocast=options.autocast,
                     channels_last=options.channels_last, batch=batch,
                     processes_per_device=local)
    while processes > 1 and side > fp.align and len(plan_batches(make_grid(
            height, width, fp, tile_size=side, uniform=True).tiles, batch)) < processes:
        smaller = legal_side(fp, side * 3 // 4)
        if smaller >= side:
            break
        side = smaller
    return replace(options, tile_size=side, batch_size=batch)


@dataclass
class RasterPlan:
    """One raster's prediction, planned.

    Attributes:
        image / output: the input and the output (``.tif`` or ``.zarr``).
        kind: ``"cog"`` or ``"zarr"``.
        working: the Zarr store tiles are written into.
        reader: the input, open.
        grid / batches: the uniform tile grid and its batches (fixed by the grid alone).
        fingerprint: everything that determines the output's values.
        names: the class names.
    """

    image: Path
    output: Path
    kind: str
    working: Path
    reader: RasterReader
    grid: TileGrid
    batches: list[Batch]
    fingerprint: dict[str, Any]
    names: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.names)


def plan_raster(image: Path, output: Path, options: PredictOptions, *, fp: Footprint,
                normalizer: Normalizer, names: list[str], weights: str,
                device: torch.device | str, exact: bool = True,
                input_hash: str | None = None) -> RasterPlan:
    """Plan ``image`` -> ``output`` (see the module docstring); opens the input.

    Args:
        image: the raster.
        output: where its prediction goes.
        options: the prediction's options.
        fp: the model's footprint.
        normalizer: raw samples to model input.
        names: the class names (their count is the model's classes).
        weights: :func:`model_digest` of the model.
        device: where the model runs (the default batch size).
        exact: False for an approximate footprint (``tiling.exact=false``): recorded.
        input_hash: :func:`input_id` of ``image``, if the caller hashed it already (an
            archive's ranks share the hashing of its scenes).
    """
    kind = output_kind(output)
    tile = options.tile_size
    if tile == "auto":
        if options.q is None:
            raise ValueError("plan_raster: tile_size=auto is resolved by with_tile first")
        tile = None  # q wins
    reader = RasterReader(image, nodata=options.nodata)
    try:
        normalizer.check_bands(reader.bands)  # before the store: nothing written
        grid = make_grid(reader.height, reader.width, fp, q=options.q, tile_size=tile,
                         uniform=True)
    except BaseException:
        reader.close()  # a grid refused for this image: its file closed before the error
        raise
    batches = plan_batches(grid.tiles, options.batch_size or default_batch_size(grid, device))
    nodata = reader.nodata
    fingerprint = {"model": weights, "input": input_hash or input_id(image), "grid":
                   [grid.height, grid.width, *grid.shape, grid.tiles[0].core.height,
                    grid.tiles[0].core.width, fp.halo, fp.align, fp.padding],
                   "batches": [len(b.tiles) for b in batches],
                   "autocast": str(options.autocast), "channels_last": options.channels_last,
                   "tta": options.tta, "probabilities": options.probabilities,
                   "normalizer": [normalizer.scale, list(normalizer.mean),
                                  list(normalizer.std)],
                   "nodata": nodata if nodata is None else float(nodata)}
    if options.fold_bn:  # the same labels up to float ties, computed otherwise: recorded
        fingerprint["fold_bn"] = True
    if options.staged:  # the same labels up to float ties, computed otherwise: recorded
        fingerprint["staged"] = True
    if not exact:  # tiling.exact=false: recorded (the output's TILING tag says so)
        fingerprint["exact"] = False
    return RasterPlan(image, output, kind, store_path(output), reader, grid, batches,
                      fingerprint, names)


def input_id(path: Path) -> str:
    """What the fingerprint knows the input by: ``blake3:<hex>`` of its bytes.

    Read whole at disk speed, hashed on every core (:func:`~.provenance.file_blake3`), once
    per run: the content, not the path, size or mtime, decides whether a finished output or
    a store is this prediction's. A raster GDAL reads from several files (a VRT and its
    sources: :func:`~seg_at_scale.io.raster.raster_files`) is known by the BLAKE3 of its
    files' hashes in GDAL's order, so a changed source is a changed input.
    """
    files = raster_files(path)
    if len(files) == 1:
        return file_blake3(files[0])
    import blake3

    return "blake3:" + blake3.blake3("\n".join(file_blake3(f) for f in files).encode()
                                     ).hexdigest()


def readable_input_id(path: Path) -> str | None:
    """:func:`input_id`, or None for a file that cannot be read.

    :func:`plan_raster` then refuses that file on every rank, naming it. One rank hashes
    a scene and gives the others its fingerprint, so N ranks do not each read the whole
    input.
    """
    try:
        return input_id(path)
    except (OSError, InputError):
        return None


def _with_sha256_input(plan: RasterPlan) -> dict[str, Any]:
    """The plan's fingerprint with the input named by SHA-256, as before BLAKE3 named it.

    An output finished or a store begun then by this same prediction is still recognised
    (the input is hashed again only when the BLAKE3 fingerprint does not match).
    """
    return {**plan.fingerprint, "input": file_sha256(plan.image)}


def reusable(plan: RasterPlan, overwrite: bool) -> list[int] | None:
    """The class histogram of this same prediction finished at the output, if any.

    Another prediction's finished output is refused unless ``overwrite``.
    """
    state = finished(plan.output)
    if state is None or overwrite:
        return None
    if state[0] != digest(plan.fingerprint) and state[0] != digest(_with_sha256_input(plan)):
        raise OutputExistsError(f"output '{plan.output}' was made by another prediction "
                                f"({_what_differs(plan)}); pass overwrite=true to replace it, "
                                "or choose another path")
    return state[1][:plan.num_classes]  # one count per class (older tags: per byte value)


def drop_working_store(plan: RasterPlan, keep_store: bool) -> None:
    """Rank 0, on reusing a finished output: remove what a killed run left beside it.

    An archive's finalising rank killed before the archive's end leaves its claim
    (:func:`~.checks.claim_path`). A run killed after its COG was renamed into place,
    before its store was deleted, leaves the store (as large as the labels, hidden); one
    killed while deleting it leaves a discarded one (:func:`~seg_at_scale.io.writer.discard`).
    """
    claim_path(plan.output).unlink(missing_ok=True)
    if plan.kind != "cog":
        return
    remove_stale_temporaries(plan.output)
    if not keep_store and plan.working.is_dir():
        discard(plan.working, plan.output)


#: what sets each part of a fingerprint, for a refusal's hint
_SET_BY = {"grid": "tile_size / q (tile_size=auto sizes tiles for the processes and device)",
           "batches": "batch_size (and tile_size)", "channels_last": "layout",
           "autocast": "fast / autocast", "model": "the model's weights", "input": "the image",
           "normalizer": "the model's normalisation", "tta": "tta",
           "probabilities": "probabilities", "nodata": "nodata", "fold_bn": "fold_bn",
           "staged": "staged", "exact": "the run's tiling.exact"}


def _what_differs(plan: RasterPlan) -> str:
    """Which fingerprint keys differ from the finished output's, and what sets them."""
    old = recorded_fingerprint(plan.output)
    if old is None:  # an output finished before the fingerprint was recorded
        return "another model, input, tiling or options"
    new = _with_sha256_input(plan) if str(old.get("input", "")).startswith("sha256:") \
        else plan.fingerprint
    keys = sorted(k for k in set(old) | set(new) if canonical({"v": old.get(k)})
                  != canonical({"v": new.get(k)}))
    said = [f"{k}: {_SET_BY[k]}" if k in _SET_BY else k for k in keys]
    return "differs in " + "; ".join(said) if said else "another prediction"


def open_store(plan: RasterPlan, options: PredictOptions) -> PredictionStore:
    """Refuse to replace another output, then resume or create the plan's store."""
    overwrite, resume = options.overwrite, options.resume
    probabilities = options.probabilities if plan.kind == "cog" else None  # a .zarr holds them
    for key, p in zip(("output", "probabilities"), cog_outputs(plan.output, probabilities),
                      strict=False):  # what is there stays until the new output replaces it
        if p.exists() and not overwrite and not rewritten_by_resume(key, plan.output):
            raise OutputExistsError(f"output '{p}' already exists; pass overwrite=true "
                                    "to replace it (or choose another path)")
    attrs = {"class_names": plan.names, "nodata": NODATA, "source": str(plan.image),
             **_georeference(plan.image)}
    fingerprint = plan.fingerprint
    if resume and str(_begun_input(plan.working)).startswith("sha256:"):
        fingerprint = _with_sha256_input(plan)  # a store begun before blake3 named inputs
    return PredictionStore.open(plan.working, plan.grid, fingerprint=fingerprint,
                                num_classes=plan.num_classes,
                                probabilities=options.probabilities, attrs=attrs,
                                resume=resume, replace=overwrite)


def _begun_input(working: Path) -> Any:
    """The input's name in the fingerprint of a store at ``working``, if there is one."""
    if not (working / "zarr.json").is_file():
        return None
    try:
        fingerprint = PredictionStore.attach(working).group.attrs.get("fingerprint")
    except OutputExistsError:
        return None  # not a prediction store: PredictionStore.open refuses it
    return fingerprint.get("input") if isinstance(fingerprint, dict) else None


def _georeference(path: Path) -> dict[str, Any]:
    """GDAL geotransform and CRS WKT of the input (empty for an image without them)."""
    with open_dataset(path) as ds:
        if ds.crs is None and ds.transform.is_identity:
            return {}
        return {"geotransform": list(ds.transform.to_gdal()),
                "crs_wkt": ds.crs.to_wkt() if ds.crs else ""}
