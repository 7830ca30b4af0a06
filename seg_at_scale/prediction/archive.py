"""Many scenes, one run: a global work queue over every scene's tiles and every rank.

``seg-predict images=<folder | glob | list.txt | STAC JSON> output_dir=<folder>`` loads the
model once and predicts every scene into ``<output_dir>/<stem>.tif`` (or ``.zarr``). The
work is one queue of units ``(scene, batch of tiles)`` in a fixed order; rank ``r`` of
``N`` takes units ``r, r + N, ...``, so one 40,000² scene and 500 small ones keep every
rank busy. Each scene is planned exactly as a single-scene run plans it
(:mod:`.plan`): the same grid, batches and fingerprint, hence byte-identical outputs
whatever ``N``. The rank that writes a scene's last tile finalises it (COG, preview,
polygons, STAC Item), claiming it with an exclusive file so that exactly one does.

A rerun skips finished scenes (their fingerprint), resumes partial ones from their
stores, and computes scenes added since. Bad scenes do not sink the archive: every scene
is checked before any tile (:func:`check_archive`); ``on_error=skip`` predicts the rest
and records each bad or failing scene in the summary (``summary.csv`` / ``.json``).

Models with a whole-image statistic (Gated-SCNN's pooling: two passes per scene) run
scene after scene, every rank on each scene's tiles.
"""

from __future__ import annotations

import contextlib
import glob
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from seg_at_scale.config_check import check_local
from seg_at_scale.data.scenes import Scene, mask_beside, paired_name, scene_images, tiff_of
from seg_at_scale.errors import ConfigError, InputError, OutputExistsError, SegAtScaleError
from seg_at_scale.io.writer import listed_once
from seg_at_scale.models.card import ModelCard
from seg_at_scale.models.trained import TrainedModel
from seg_at_scale.parallel.launch import barrier, rank_world
from seg_at_scale.prediction.checks import check_scene, claim_path
from seg_at_scale.prediction.compile_choice import checked_network
from seg_at_scale.prediction.finalize import finalize
from seg_at_scale.prediction.layout_choice import with_layout
from seg_at_scale.prediction.options import PredictOptions
from seg_at_scale.prediction.plan import (
    RasterPlan,
    drop_working_store,
    model_digest,
    open_store,
    plan_raster,
    prediction_network,
    readable_input_id,
    reusable,
)
from seg_at_scale.prediction.progress import progress_bar
from seg_at_scale.prediction.raster import (
    PredictionStats,
    SceneWork,
    agreed,
    on_rank0,
    predict_scenes,
    raised_everywhere,
    scene_tile,
)
from seg_at_scale.prediction.scene import companions, predict_scene
from seg_at_scale.prediction.staged_raster import check_staged
from seg_at_scale.prediction.store import PredictionStore
from seg_at_scale.tiling.engine import PartError, forward_shapes
from seg_at_scale.tiling.geometry import fill_of
from seg_at_scale.tiling.statistic_passes import has_statistics
from seg_at_scale.tiling.statistics import uses_image_pool

__all__ = ["ArchiveScene", "find_images", "archive_scenes", "check_archive", "check_merge",
           "predict_archive", "SceneRecord", "RASTER_SUFFIXES", "VECTOR_FORMATS",
           "scene_writes", "check_output_names"]

RASTER_SUFFIXES = (".tif", ".tiff")
VECTOR_FORMATS = ("gpkg", "parquet", "fgb")
MAX_LISTED = 5


@dataclass(frozen=True)
class ArchiveScene:
    """One scene of an archive and where its outputs go."""

    stem: str
    image: Path
    output: Path
    mask: Path | None = None
    vector: Path | None = None


@dataclass
class SceneRecord:
    """What happened to one scene (a row of the summary)."""

    stem: str
    image: str
    output: str
    status: str = "pending"  # done | reused | skipped | failed
    reason: str = ""
    tiles: int = 0
    tiles_computed: int = 0
    tiles_resumed: int = 0
    seconds: float = 0.0
    megapixels: float = 0.0
    finalized_by: int = -1
    tiles_by_rank: list[int] = field(default_factory=list)
    class_pixels: list[int] = field(default_factory=list)
    miou: float | None = None
    iou: list[float | None] = field(default_factory=list)


def find_images(images: str) -> list[tuple[str, Path]]:
    """``(stem, path)`` of every scene ``images`` names, in a fixed order.

    ``images`` is a folder (its ``.tif`` / ``.tiff`` files; of a split folder in a
    training layout, :func:`~seg_at_scale.data.scenes.scene_images`, the images named by
    their scene, ``a`` for ``a_image.tif`` beside ``a_mask.tif``, which is not a scene),
    a glob pattern, a ``.txt``
    list (one path per line, relative to the list's folder; ``#`` comments), or STAC JSON
    (an ItemCollection, Catalog or Collection: its items' image assets). A scene's stem,
    the name of its outputs, is the file's stem or the item's id, made one plain file
    name by :func:`~seg_at_scale.catalog.names.output_stem` (``../x`` -> ``x``).

    Raises:
        InputError: nothing found, a name that gives no stem, or two scenes that would
            share an output name.
    """
    from seg_at_scale.catalog.names import output_stem

    src = Path(images)
    named: list[tuple[str, Path, str]]  # (name, image, what the name is)
    if src.suffix.lower() == ".json" and src.is_file():
        from seg_at_scale.catalog import image_hrefs

        named = [(name, Path(href), f"images='{images}': item {name!r}")
                 for name, href in image_hrefs(src)]
    elif src.suffix.lower() == ".txt" and src.is_file():
        lines = [ln.split("#", 1)[0].strip() for ln in src.read_text().splitlines()]
        for n, ln in enumerate(lines, 1):
            check_local(f"images='{images}': line {n} '{ln}'", ln, error=InputError)
        paths = [src.parent / ln if not Path(ln).is_absolute() else Path(ln)
                 for ln in lines if ln]
        named = [(p.stem, p, f"images='{images}': image '{p}'") for p in paths]
    elif src.is_dir():
        files = [p for p in sorted(src.iterdir())
                 if p.suffix.lower() in RASTER_SUFFIXES and not p.name.startswith(".")]
        # a split folder of a training layout: its images by scene name, not their masks
        paired = {p for p in files if paired_name(p) is not None and mask_beside(p) in files}
        masks = {mask_beside(p) for p in paired}
        named = ([(Scene(p).name if p in paired else p.stem, p, f"image '{p}'")
                  for p in files if p not in masks] if files else
                 [(Scene(p).name, p, f"image '{p}'")  # images/ + masks/
                  for p in scene_images(src, key=f"images='{images}'") or []])
    else:
        named = [(Path(p).stem, Path(p), f"image '{p}'") for p in sorted(glob.glob(images))]
    if not named and not src.exists() and not any(c in images for c in "*?["):
        raise InputError(f"images='{images}' does not exist; give a folder of .tif files, "
                         "a glob such as 'scenes/*.tif', a .txt list or a STAC JSON file")
    if not named:
        others = sorted({p.suffix for p in src.iterdir() if p.suffix}) if src.is_dir() else []
        hint = (f" (it holds {', '.join(others[:5])} files: give them as a glob, e.g. "
                f"images='{src / ('*' + others[0])}')" if others else "")
        raise InputError(f"images='{images}' names no rasters{hint}; give a folder of .tif "
                         "files, a glob such as 'scenes/*.tif', a .txt list or a STAC JSON "
                         "file")
    found = [(output_stem(name, what=what), path) for name, path, what in named]
    fix = "the items distinct ids" if src.suffix.lower() == ".json" else \
        "scenes distinct names"
    seen: dict[str, tuple[str, Path]] = {}
    for (stem, path), (name, _, _) in zip(found, named, strict=True):
        if stem in seen:
            first, before = seen[stem]
            ids = f" (from {first!r} and {name!r})" if (first, name) != (stem, stem) else ""
            raise InputError(f"images='{images}': '{before}' and '{path}' would both be "
                             f"written as '{stem}'{ids}; give {fix}")
        seen[stem] = (name, path)
    return found


def _mask_of(masks: Path | None, stem: str, image: Path | None = None) -> Path | None:
    """The truth of scene ``stem`` in the folder ``masks``, or None.

    ``<stem>.tif`` or ``<stem>_mask.tif``; in a split folder of the ``images/`` +
    ``masks/`` layout, ``masks/<stem>.tif`` below it (``.tif`` or ``.tiff``, any case).
    Never the scene's ``image`` itself (``masks=`` the folder of the images).
    """
    if masks is None:
        return None
    for name in (stem, f"{stem}_mask", f"masks/{stem}"):
        found = tiff_of(masks / f"{name}.tif")
        if found.is_file() and not (image is not None and found.resolve() == image.resolve()):
            return found
    return None


def archive_scenes(images: str, output_dir: Path, *, output_format: str = "tif",
                   masks: Path | None = None, vector: str | None = None,
                   vector_merge: bool = False,
                   options: PredictOptions | None = None) -> list[ArchiveScene]:
    """The archive's scenes with their outputs (``<output_dir>/<stem>.<format>``).

    Polygons go to ``<output_dir>/<stem>.<vector>``, or with ``vector_merge`` to
    ``<output_dir>/vectors/`` (the pieces :func:`~.report.merge_vectors` joins into one
    file; kept, so a rerun or an added scene merges again without recomputing, and named
    by each scene's STAC Item: a folder a static host publishes, not a dot-folder). Given the
    prediction's ``options``, every path any scene writes is checked unique across the
    archive (:func:`check_output_names`) before anything is written.
    """
    if vector is not None and vector not in VECTOR_FORMATS:
        raise ConfigError(f"vector={vector!r} with images=: give the format of one vector "
                          f"file per scene, one of {', '.join(VECTOR_FORMATS)}")
    if masks is not None and not masks.is_dir():
        raise InputError(f"masks='{masks}' is not a folder; give the folder of ground-truth "
                         "rasters named <stem>.tif or <stem>_mask.tif")
    if vector_merge and vector is None:
        raise ConfigError("vector_merge=true needs vector=<gpkg | parquet | fgb>")
    pieces = output_dir / "vectors" if vector_merge else output_dir
    scenes = [ArchiveScene(stem, image, output_dir / f"{stem}.{output_format}",
                           _mask_of(masks, stem, image),
                           pieces / f"{stem}.{vector}" if vector else None)
              for stem, image in find_images(images)]
    if options is not None:
        check_output_names(scenes, options)
    return scenes


def scene_writes(scene: ArchiveScene, options: PredictOptions) -> dict[str, Path]:
    """Every path one scene of the archive writes, by the key users know it by.

    :func:`~.checks.scene_outputs` (the one rule of a scene's outputs: labels, working
    store, probabilities, preview, polygons, STAC Item), and the record beside the
    polygons of the options they were made with. Every temporary or partial file is
    ``.<name>.<tag>...`` beside one of these (``<tag>``: ``partial`` / ``plain`` / ``cog``
    / ``ov<k>``, with the writer's pid and a random part): hidden, so it meets no scene's
    name (a stem never starts with a dot), and distinct whenever these names are.
    """
    from seg_at_scale.prediction.checks import scene_outputs
    from seg_at_scale.prediction.scene import vector_record

    writes = dict(scene_outputs(scene.output, options, scene.vector))
    if scene.vector is not None:
        writes["polygons' options record"] = vector_record(scene.vector)
    return writes


def check_output_names(scenes: Sequence[ArchiveScene], options: PredictOptions) -> None:
    """Refuse an archive in which two scenes write one path, or one writes another's input.

    ``a.tif`` and ``a_probabilities.tif`` with ``probabilities=uint8``: the second scene's
    labels replaced the first's probabilities, exit 0. Checked before any work, over
    :func:`scene_writes` of every scene; paths compared after symlinks and ``..``.

    Raises:
        InputError: naming both scenes, the path and what each writes or reads there.
    """
    inputs: dict[str, tuple[ArchiveScene, str]] = {}
    for s in scenes:
        for key, path in (("image", s.image), ("mask", s.mask)):
            if path is not None:
                inputs.setdefault(os.path.realpath(path), (s, key))
    writes: dict[str, tuple[ArchiveScene, str]] = {}
    for s in scenes:
        for key, path in scene_writes(s, options).items():
            real = os.path.realpath(path)
            other = writes.get(real) or inputs.get(real)
            if other is not None and other[0] is not s:
                t, what = other
                raise InputError(
                    f"scenes '{t.stem}' ('{t.image}') and '{s.stem}' ('{s.image}') both use "
                    f"'{path}' (the {what} of '{t.stem}', the {key} of '{s.stem}'): one would "
                    f"replace the other and nothing was written; rename one of the two "
                    f"scenes{_option_fix(key, what)}")
            writes[real] = (s, key)


def _option_fix(*keys: str) -> str:
    """The options that make the clashing companions, for the refusal's fix."""
    made = {"probabilities": "probabilities=null", "preview": "preview=false",
            "stac": "stac=false"}
    drop = [made[k] for k in dict.fromkeys(keys) if k in made]
    return f" or pass {' '.join(drop)}" if drop else ""


def check_archive(scenes: Sequence[ArchiveScene], options: PredictOptions, *,
                  card: ModelCard, source: str, model_files: dict[str, Path],
                  cuda: bool, on_error: str) -> list[SceneRecord]:
    """Check every scene before any tile; the bad ones as ``skipped`` records.

    Raises:
        InputError: with ``on_error=stop``, naming every bad scene and why (one message).
        SegAtScaleError: every scene refused for one reason (a key of the run, not a scene).
    """
    bad, errors = [], []
    for s in scenes:
        try:
            check_scene(s.image, s.output, options, card=card, source=source,
                        model_files=model_files, mask=s.mask, cuda=cuda, vector=s.vector)
        except SegAtScaleError as exc:  # a scene's input, its output or a value it cannot hold
            bad.append(SceneRecord(s.stem, str(s.image), str(s.output), "skipped", str(exc)))
            errors.append(exc)
    one_reason = len(bad) == len(scenes) and len({r.reason for r in bad}) == 1
    if one_reason and (len(scenes) > 1 or isinstance(errors[0], ConfigError)):
        raise errors[0]  # a bad option (vector_classes=, the model's card): not the scenes
    if bad and on_error == "stop":
        listed = "; ".join(f"{r.stem}: {r.reason.rstrip('.')}" for r in bad[:MAX_LISTED])
        more = f"; ... and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else ""
        raise InputError(f"{len(bad)} of {len(scenes)} scenes cannot be predicted, so nothing "
                         f"was computed: {listed}{more}. Fix them, or pass on_error=skip to "
                         "predict the others (summary.csv lists the skipped ones)")
    return bad


def check_merge(scenes: Sequence[ArchiveScene], refused: Sequence[SceneRecord]) -> None:
    """Refuse ``vector_merge=true`` over scenes with a CRS and scenes without one.

    Polygons of a scene without georeferencing are in its pixel coordinates: merged into a
    layer in a CRS, they were placed as if they were metres. Scenes in different CRSs are
    merged, reprojected to the first one's (:func:`~.report.merge_vectors`). Read before
    any tile (the CRS of each scene, through GDAL).
    """
    from seg_at_scale.io.geotags import open_dataset

    skipped = {r.stem for r in refused}
    placed: ArchiveScene | None = None
    plain: ArchiveScene | None = None
    crs_of_placed = ""
    for s in scenes:
        if s.stem in skipped:
            continue
        with open_dataset(s.image) as ds:
            if ds.crs is None:
                plain = plain or s
            elif placed is None:
                placed, crs_of_placed = s, ds.crs.to_string()
        if placed is not None and plain is not None:
            raise ConfigError(
                f"vector_merge=true: scene '{plain.stem}' has no CRS (its polygons are in "
                f"pixel coordinates) and scene '{placed.stem}' is in {crs_of_placed}: their "
                "polygons cannot share one layer and nothing was computed; predict them as "
                "two archives, or drop vector_merge (one polygon file per scene)")


def predict_archive(trained: TrainedModel, scenes: Sequence[ArchiveScene],
                    options: PredictOptions, *, on_error: str = "stop",
                    checked: Sequence[SceneRecord] = ()) -> list[SceneRecord]:
    """Predict every scene on every rank's share of the global queue (module docstring).

    Args:
        trained: the model, on the device it runs on.
        scenes: the archive's scenes (the ones ``checked`` lists as skipped are left out).
        options: the prediction's options.
        on_error: ``stop`` (a scene failing mid-run stops the run) or ``skip`` (recorded,
            the others go on).
        checked: records of the scenes refused by :func:`check_archive`.

    Returns:
        On rank 0, a record per scene (others: their own records).
    """
    skipped = {r.stem for r in checked}
    todo = [s for s in scenes if s.stem not in skipped]
    if options.staged:  # refused as image= refuses it, before any scene is touched
        check_staged(trained.model, options, rank_world()[1])
    with contextlib.ExitStack() as held:
        busy = _lock_scenes(todo, held, on_error)
        todo = [s for s in todo if s.stem not in busy]
        held.enter_context(listed_once(  # one listing of each output folder, not per scene
            [s.output.parent for s in todo] + [s.vector.parent for s in todo if s.vector]))
        if options.staged or uses_image_pool(trained.model) or has_statistics(trained.model):
            records = _scene_by_scene(trained, todo, options, on_error)
        else:
            records = _queue(trained, todo, options, on_error)
    return [*checked, *busy.values(), *records]


def _lock_scenes(scenes: Sequence[ArchiveScene], held: contextlib.ExitStack,
                 on_error: str) -> dict[str, SceneRecord]:
    """Rank 0 claims every scene's output for the whole run; the busy ones are refused.

    A scene a one-scene run is writing is refused on every rank (``on_error=skip``: as a
    ``skipped`` record), and a one-scene run of a claimed scene is refused at its lock
    (:func:`~.lock.archive_claim`): the two never write one scene at once.
    """
    from seg_at_scale.prediction.lock import archive_claim

    refused: dict[int, str] = {}
    if rank_world()[0] == 0:
        try:
            refused = dict(held.enter_context(archive_claim([s.output for s in scenes])))
        except SegAtScaleError as exc:  # another archive claims the folder
            refused = {-1: str(exc)}
    refused = _everyone(refused)
    if -1 in refused:
        raise agreed(OutputExistsError(refused[-1]))
    if refused and on_error == "stop":
        raise agreed(OutputExistsError(refused[min(refused)]))
    return {scenes[i].stem: SceneRecord(scenes[i].stem, str(scenes[i].image),
                                        str(scenes[i].output), "skipped", reason)
            for i, reason in sorted(refused.items())}


def _scene_by_scene(trained: TrainedModel, scenes: Sequence[ArchiveScene],
                    options: PredictOptions, on_error: str) -> list[SceneRecord]:
    """Every rank on one scene at a time, through the one-scene job (:func:`predict_scene`).

    For what runs a whole scene at once: statistic passes (each scene's statistics first)
    and staged prediction (each stage over the whole scene's maps).
    """
    records = []
    for s in scenes:
        rec = SceneRecord(s.stem, str(s.image), str(s.output))
        t0 = time.perf_counter()
        try:
            res = predict_scene(trained, s.image, s.output, options, mask=s.mask,
                                checked=True, vector=s.vector)
        except (SegAtScaleError, OSError) as exc:
            if on_error == "stop" or not raised_everywhere(exc):
                raise  # an error on this rank alone, mid-scene: the others cannot go on
            rec.status, rec.reason = "failed", str(exc)
        else:
            rec.status = "reused" if res["tiles_computed"] == 0 else "done"
            rec.tiles, rec.tiles_computed = res["tiles"], res["tiles_computed"]
            rec.tiles_resumed, rec.class_pixels = res["tiles_resumed"], res["class_pixels"]
            rec.miou, rec.iou = res.get("miou"), res.get("iou", [])
        rec.seconds = time.perf_counter() - t0
        records.append(rec)
    return records


def _queue(trained: TrainedModel, scenes: Sequence[ArchiveScene], options: PredictOptions,
           on_error: str) -> list[SceneRecord]:
    """The global work queue (module docstring); the merged records on rank 0."""
    rank, world = rank_world()
    model = trained.model.eval()
    options = with_layout(options, model, trained.bands, decide=on_rank0)
    if options.channels_last:
        model = model.to(memory_format=torch.channels_last)
    device = next(model.parameters()).device
    weights = model_digest(model)
    hashes = _input_hashes(scenes)
    plans = []
    for i, s in enumerate(scenes):
        scene_options = scene_tile(options, model, trained.footprint, s.image, world)
        plans.append(plan_raster(s.image, s.output, scene_options, fp=trained.footprint,
                                 normalizer=trained.normalizer, names=trained.class_names,
                                 weights=weights, device=device,
                                 exact=trained.card.exact,
                                 input_hash=hashes.get(i)))
        plans[-1].reader.close()  # reopened by the rank that reads it: one file open at once
    if plans:
        model = prediction_network(model, options, plans[0].reader.bands, trained.footprint,
                                   trained.num_classes)
    records = [SceneRecord(s.stem, str(s.image), str(s.output), tiles=len(p.grid),
                           megapixels=p.grid.height * p.grid.width / 1e6)
               for s, p in zip(scenes, plans, strict=True)]
    stores = _open_stores(plans, records, options, on_error)
    units = [(i, b) for i, p in enumerate(plans) if (store := stores[i]) is not None
             for b in p.batches if not all(store.done(t) for t in b.tiles)]
    for i, p in enumerate(plans):
        if stores[i] is not None:
            done = len(p.grid) - sum(len(b.tiles) for j, b in units if j == i)
            records[i].tiles_resumed = done
    barrier()  # nobody writes before every rank has listed what is left
    mine = units[rank::world]
    show = options.progress if options.progress is not None else not os.environ.get("CI")
    total = sum(len(b.tiles) for _, b in units)
    per_tile = sum(r.megapixels for r in records) * 1e6 / max(1, sum(r.tiles for r in records))
    shapes: Counter[tuple[int, int, int]] = Counter()  # the archive's: compiles pay across scenes
    for i, b in mine:
        g = plans[i].grid
        shapes.update(forward_shapes([b], height=g.height, width=g.width, fp=g.footprint,
                                     tta=options.tta))
    net = checked_network(model, options.compile, shapes)
    order = [i for i in _in_order(mine) if records[i].status != "failed"]
    with progress_bar(total, show and rank == 0, per_tile, world, "archive") as bar, \
            _Finisher() as finisher:
        _run_scenes(trained, model, net, scenes, plans, stores, mine, order, options, records,
                    bar, on_error, finisher)
    barrier()
    return _gather(records, plans, stores, scenes, trained, options, on_error)


def _input_hashes(scenes: Sequence[ArchiveScene]) -> dict[int, str]:
    """Every scene's :func:`~.plan.input_id`, each hashed by one rank and shared (a collective).

    A scene that cannot be read is left out: :func:`~.plan.plan_raster` reports it on
    every rank.
    """
    rank, world = rank_world()
    mine = {i: readable_input_id(s.image) for i, s in enumerate(scenes) if i % world == rank}
    return _everyone({i: h for i, h in mine.items() if h is not None})


def _in_order(units: list[tuple[int, Any]]) -> list[int]:
    return list(dict.fromkeys(i for i, _ in units))


def _open_stores(plans: list[RasterPlan], records: list[SceneRecord],
                 options: PredictOptions, on_error: str) -> list[PredictionStore | None]:
    """Finished scenes reused; every other scene's store opened by one rank, then shared."""
    rank, world = rank_world()
    finished_otherwise: dict[int, str] = {}  # the same on every rank: they read one file
    for i, p in enumerate(plans):
        try:
            pixels = reusable(p, options.overwrite)  # every rank reads the same finished file
        except OutputExistsError as exc:
            finished_otherwise[i] = str(exc)
            continue
        if pixels is not None:
            if rank == 0:
                drop_working_store(p, options.keep_store)
            records[i].status, records[i].class_pixels = "reused", pixels
            records[i].tiles_resumed = records[i].tiles
    refused: dict[int, str] = {}
    for i, p in enumerate(plans):
        if records[i].status == "pending" and i % world == rank and i not in finished_otherwise:
            try:  # a leftover store of another prediction, an output of another run
                store = open_store(p, options)
            except SegAtScaleError as exc:
                refused[i] = str(exc)
                continue
            claim_path(p.output).unlink(missing_ok=True)  # a killed finaliser's claim
            del store
    refused = {**_everyone(refused), **finished_otherwise}  # every rank agrees (and waits)
    if refused and on_error == "stop":  # every such scene named, nothing computed
        listed = "; ".join(f"{records[i].stem}: {refused[i]}"
                           for i in sorted(refused)[:MAX_LISTED])
        more = f"; ... and {len(refused) - MAX_LISTED} more" if len(refused) > MAX_LISTED \
            else ""
        raise OutputExistsError(
            refused[min(refused)] if len(refused) == 1 else
            f"{len(refused)} of {len(plans)} scenes have an output or store of another "
            f"prediction, so nothing was computed: {listed}{more}")
    for i, reason in sorted(refused.items()):
        records[i].status, records[i].reason = "failed", reason
    return [PredictionStore.attach(p.working) if records[i].status == "pending" else None
            for i, p in enumerate(plans)]


def _everyone(mine: dict[int, str]) -> dict[int, str]:
    """Every rank's entries merged, on every rank (a collective: every rank calls it)."""
    if rank_world()[1] == 1:
        return mine
    every: list[Any] = [None] * rank_world()[1]
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


class _Finisher:
    """Finalises completed scenes on one background thread while the next scene runs.

    One scene at a time: submitting the next waits for the one before (bounded memory,
    errors surface in order); leaving waits for the last. A scene's COG, overviews and
    companions are written while the network already reads the next scene's tiles.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="finish")
        self._pending: Future[None] | None = None

    def submit(self, fn: Callable[[], None]) -> None:
        self.wait()
        self._pending = self._pool.submit(fn)

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __enter__(self) -> _Finisher:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.wait()
            elif self._pending is not None:  # unwinding: let the finaliser end, quietly
                self._pending.exception()
        finally:
            self._pool.shutdown(wait=True)


def _run_scenes(trained: TrainedModel, model: torch.nn.Module, net: Any,
                scenes: Sequence[ArchiveScene], plans: list[RasterPlan],
                stores: list[PredictionStore | None], mine: list[tuple[int, Any]],
                order: list[int], options: PredictOptions, records: list[SceneRecord],
                bar: Any, on_error: str, finisher: _Finisher) -> None:
    """This rank's batches of the scenes in ``order``, one stream through the tile engine.

    The next scene's first tiles are read while the last batch of one runs; each scene
    this rank completes is finalised on the finisher's thread, beside the next scenes.

    A scene that fails (``on_error=skip``) is recorded and the stream goes on after it.
    """
    from seg_at_scale.data.windows import RasterWindows

    while order:
        works = []
        for i in order:
            stats = PredictionStats(plans[i].output, plans[i].grid.height,
                                    plans[i].grid.width, len(plans[i].grid),
                                    plans[i].grid.efficiency)
            store = stores[i]
            assert store is not None  # failed scenes are not in the order
            works.append(SceneWork(RasterWindows(plans[i].reader, trained.normalizer,
                                                 fill_of(trained.footprint)),
                                   [b for j, b in mine if j == i], plans[i].grid, store, stats))

        def written(k: int, order: list[int] = order, works: list[SceneWork] = works) -> None:
            i = order[k]
            _scene_written(trained, scenes[i], plans[i], works[k], options, records[i],
                           on_error, finisher)

        try:
            predict_scenes(model, works, options, bar, net=net, on_written=written)
            return
        except PartError as exc:
            i, cause = order[exc.part], exc.cause
            _count(records[i], works[exc.part].stats)
            plans[i].reader.close()
            if (on_error == "stop" or _disk_full(cause)
                    or not isinstance(cause, (SegAtScaleError, OSError))):
                raise cause from None
            records[i].status, records[i].reason = "failed", str(cause)
            order = order[exc.part + 1:]


def _scene_written(trained: TrainedModel, scene: ArchiveScene, plan: RasterPlan,
                   work: SceneWork, options: PredictOptions, record: SceneRecord,
                   on_error: str, finisher: _Finisher) -> None:
    """Every batch this rank had of the scene is on disk: finalise it, or close its file.

    The scene is finalised (on the finisher's thread) when it is complete and this rank
    claims it.
    """
    stats = work.stats
    _count(record, stats)
    try:
        if all(work.store.done(t) for t in plan.grid.tiles) and _claim(plan):
            finisher.submit(lambda: _finish_guarded(trained, scene, plan, work.store, options,
                                                    record, stats, on_error))
            return
    except (SegAtScaleError, OSError) as exc:
        if on_error == "stop" or _disk_full(exc):
            raise
        record.status, record.reason = "failed", str(exc)
    plan.reader.close()


def _count(record: SceneRecord, stats: PredictionStats) -> None:
    """A scene's tiles and seconds of this rank's stream (the finisher adds its own)."""
    record.tiles_computed += stats.tiles_computed
    record.seconds += stats.model_s + stats.read_wait_s + stats.write_s


def _finish_guarded(trained: TrainedModel, scene: ArchiveScene, plan: RasterPlan,
                    store: PredictionStore, options: PredictOptions, record: SceneRecord,
                    stats: PredictionStats, on_error: str) -> None:
    """:func:`_finish` on the finisher's thread: a failure recorded, or raised to stop."""
    t0 = time.perf_counter()
    try:
        _finish(trained, scene, plan, store, options, record, stats)
    except (SegAtScaleError, OSError) as exc:
        if on_error == "stop" or _disk_full(exc):
            raise
        record.status, record.reason = "failed", str(exc)
    finally:
        plan.reader.close()
        record.seconds += time.perf_counter() - t0


def _disk_full(exc: BaseException) -> bool:
    from seg_at_scale.errors import disk_full

    return disk_full(exc) is not None


def _claim(plan: RasterPlan) -> bool:
    """Whether this rank is the one to finalise the scene (an exclusive file decides).

    The claim stays until every rank has finished the archive (:func:`_gather`): a rank
    that found the scene complete a moment before another finalised it finds the claim
    still there, not a store already published or discarded.
    """
    try:
        os.close(os.open(claim_path(plan.output), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _finish(trained: TrainedModel, scene: ArchiveScene, plan: RasterPlan,
            store: PredictionStore, options: PredictOptions, record: SceneRecord,
            stats: PredictionStats) -> None:
    """Finalise a completed scene: the COG (or the store published), its companions."""
    record.class_pixels = finalize(store, plan.output, plan.kind, plan.reader, plan.names,
                                   options.probabilities, options.overwrite,
                                   options.keep_store)
    record.finalized_by = rank_world()[0]
    companions(trained, scene.image, plan.output, options, scene.vector, stats)
    record.status = "done"


def _gather(records: list[SceneRecord], plans: list[RasterPlan],
            stores: list[PredictionStore | None], scenes: Sequence[ArchiveScene],
            trained: TrainedModel, options: PredictOptions, on_error: str) -> list[SceneRecord]:
    """Rank 0: every rank's records merged; a complete scene nobody finalised, finalised."""
    rank, world = rank_world()
    mine = [vars(r) for r in records]
    every = [mine]
    if world > 1:
        every = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(every, mine)
    merged = []
    for i, rec in enumerate(records):
        rows = [SceneRecord(**ranks[i]) for ranks in every]
        out = SceneRecord(**vars(rec))
        out.tiles_by_rank = [r.tiles_computed for r in rows]
        out.tiles_computed = sum(out.tiles_by_rank)
        out.seconds = sum(r.seconds for r in rows)
        final = [r for r in rows if r.status in ("done", "failed")]
        if final:
            src = next((r for r in final if r.status == "failed"), final[0])
            out.status, out.reason = src.status, src.reason
            out.class_pixels, out.finalized_by = src.class_pixels, src.finalized_by
        merged.append(out)
    if rank == 0:
        for plan in plans:  # every rank is past its scenes' claims
            claim_path(plan.output).unlink(missing_ok=True)
        for i, rec in enumerate(merged):
            _complete(trained, scenes[i], plans[i], stores[i], options, rec, on_error)
    for plan in plans:
        plan.reader.close()
    return merged


def _complete(trained: TrainedModel, scene: ArchiveScene, plan: RasterPlan,
              store: PredictionStore | None, options: PredictOptions,
              rec: SceneRecord, on_error: str) -> None:
    """Rank 0, at the end: what a killed earlier run (or finaliser) left undone.

    Raises:
        InputError: with ``on_error=stop``, a scene whose tiles are not all written though
            every rank finished without an error (else it is recorded as failed).
    """
    stats = PredictionStats(plan.output, plan.grid.height, plan.grid.width, len(plan.grid),
                            plan.grid.efficiency)
    if rec.status == "reused":  # a companion killed before it was written
        stats.reused = True
        companions(trained, scene.image, plan.output, options, scene.vector, stats)
    elif rec.status == "pending" and store is not None:
        missing = sum(not store.done(t) for t in plan.grid.tiles)
        if not missing:  # a finaliser killed mid-way
            _finish(trained, scene, plan, store, options, rec, stats)
            return
        rec.status = "failed"
        rec.reason = (f"{missing} of {len(plan.grid)} tiles of '{plan.output}' are missing "
                      f"from its store '{plan.working}' after every rank finished; rerun the "
                      "same command to compute them")
        if on_error == "stop":
            raise InputError(rec.reason)
