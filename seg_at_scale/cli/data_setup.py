"""The training entry point's data side: scenes made, checked and normalised before work.

In order: the synthetic scenes are written if the data config asks for them, the
``data`` and ``tiling`` groups are validated (:mod:`seg_at_scale.data.config`), every
split's files pass the preflight (:mod:`seg_at_scale.data.preflight`), ``auto``
normalisation is worked out from the training split (:mod:`seg_at_scale.data.band_stats`)
and every grid the run will walk is checked against its scenes. Only then is the
DataModule built (``instantiate(cfg.data, ...)``: the ``data`` group's ``_target_`` is
:class:`~seg_at_scale.data.datamodule.TileDataModule`), from the scenes the preflight
validated.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
from filelock import FileLock
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from seg_at_scale.cli.runs import RunFolder
from seg_at_scale.config_check import check_local
from seg_at_scale.data.band_stats import BandSums, auto_normalization, sample_sums
from seg_at_scale.data.config import (
    AUTO,
    DataConfig,
    TilingConfig,
    check_class_weight_power,
    data_config,
    tiling_config,
)
from seg_at_scale.data.preflight import CACHE_NAME, FactCache, PreflightReport, preflight
from seg_at_scale.data.sources.base import Source
from seg_at_scale.errors import ConfigError, InputError
from seg_at_scale.io import RasterReader
from seg_at_scale.tiling import Footprint, make_grid
from seg_at_scale.tiling.geometry import TilingError

__all__ = ["checked_groups", "make_synthetic", "source_of", "synthesize", "run_preflight",
           "resolve_normalization", "check_grids", "record_training_data", "training_sample"]

log = logging.getLogger("seg_at_scale.train")
DEFAULT_SOURCE = "seg_at_scale.data.sources.synthetic.SyntheticScenes"


def _plain(node: Any) -> dict[str, Any]:
    out = OmegaConf.to_container(node, resolve=True)
    assert isinstance(out, dict)
    return cast(dict[str, Any], out)  # a config group: its keys are names


def checked_groups(cfg: DictConfig) -> tuple[DataConfig, TilingConfig]:
    """The ``data`` and ``tiling`` groups, validated (key, value and fix on a bad one)."""
    check_class_weight_power(cfg.data.get("class_weight_power"))  # data.class_weights' input
    return data_config(_plain(cfg.data)), tiling_config(_plain(cfg.tiling))


def synthesize(cfg: DictConfig) -> None:
    """:func:`make_synthetic` from the raw config (only ``data.root`` / ``data.synthetic``).

    ``data.class_names=null`` takes the source's class table where it has one (TACO's
    categories, read from its ``annotations.json``).
    """
    syn = cfg.data.get("synthetic")
    table = make_synthetic(str(cfg.data.root), _plain(syn) if syn is not None else None,
                           num_classes=cfg.data.num_classes)
    if table is not None and cfg.data.get("class_names") is None:
        cfg.data.class_names = list(table)


def source_of(synthetic: Mapping[str, Any]) -> Source:
    """The dataset source the ``data.synthetic`` node names, built from that node.

    ``generator`` names a :class:`~seg_at_scale.data.sources.base.Source` class (the
    satellite scenes by default); it is built from ``splits`` / ``height`` / ``width`` /
    ``seed`` and its ``options``, refused naming the keys when they do not fit.
    """
    path = synthetic.get("generator") or DEFAULT_SOURCE
    try:
        cls = get_class(path)
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"data.synthetic.generator={path!r} is not a class: name a "
                          "seg_at_scale.data.sources.base.Source subclass, e.g. "
                          f"{DEFAULT_SOURCE}") from exc
    if not issubclass(cls, Source):
        raise ConfigError(f"data.synthetic.generator={path!r} is not a dataset source: name "
                          f"a seg_at_scale.data.sources.base.Source subclass, e.g. "
                          f"{DEFAULT_SOURCE}")
    keys = {k: synthetic[k] for k in ("splits", "height", "width", "seed") if k in synthetic}
    options = dict(synthetic.get("options") or {})
    try:
        inspect.signature(cls).bind(**keys, **options)
    except TypeError as exc:
        raise ConfigError(f"data.synthetic / data.synthetic.options do not fit {cls.__name__}"
                          f"{inspect.signature(cls)}: {exc}; set the keys it takes") from exc
    return cls(**keys, **options)


def make_synthetic(root: str, synthetic: Mapping[str, Any] | None, *,
                   num_classes: int | None = None) -> Sequence[str] | None:
    """Write (or reuse) the source's scenes when ``data.synthetic.enabled``; its class table.

    Runs first (before the ``data`` group is resolved whole): ``data.class_weights`` may be
    computed from the training masks these scenes are. A ``num_classes`` other than the
    length of the source's class table is refused before anything is written.
    """
    check_local(f"data.root='{root}'", root)  # before any folder is made from it
    syn = synthetic or {}
    if not syn.get("enabled"):
        return None
    source = source_of(syn)
    table = source.classes
    if table is not None and num_classes is not None and num_classes != len(table):
        raise ConfigError(f"data.num_classes={num_classes} but {source.name}'s class table has "
                          f"{len(table)} classes ({', '.join(table[:4])}, ...): set "
                          f"data.num_classes={len(table)}")
    folder = Path(root)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # parallel trials and DDP ranks start together: the first generates, the others wait
    with FileLock(folder.parent / f".{folder.name}.lock"):
        # data.synthetic.overwrite=true: rebuild a folder made with other parameters
        source.build(folder, overwrite=bool(syn.get("overwrite", False)))
    return table


def run_preflight(data: DataConfig, run: RunFolder, predict_after_fit: bool) -> PreflightReport:
    """Every split the run reads, checked from headers and (cached) pixel passes."""
    splits = ["train", "val"] + (["test"] if predict_after_fit else [])
    # a scale the user gave is checked against the dtype; one the run worked out is not
    fixed = (cast(float, data.scale)  # a number unless auto (DataConfig checks it)
             if "data.scale" not in run.filled and data.scale != AUTO else None)
    test = Path(data.root) / "test"
    if predict_after_fit and not test.exists() and (Path(data.root) / "train").is_dir():
        raise InputError(f"data.root: '{test}' does not exist: the held-out scenes seg-train "
                         "predicts and scores after training; add a test/ split, or pass "
                         "predict_after_fit=false to train without one")
    return preflight(data.root, splits, bands=data.bands, num_classes=data.num_classes,
                     ignore_index=data.ignore_index, mask_bands=data.mask_bands,
                     nodata=data.nodata, scale=fixed, cache=Path(data.root) / CACHE_NAME)


def resolve_normalization(cfg: DictConfig, run: RunFolder, report: PreflightReport,
                          computed: dict[str, Any]) -> None:
    """``data.scale`` / ``mean`` / ``std`` = ``auto``: worked out once, saved in the run."""
    d = cfg.data
    if AUTO not in (d.scale, d.mean, d.std):
        return

    @functools.cache
    def numbers() -> dict[str, Any]:
        return auto_normalization(report.dtype, training_sample(cfg, report), d.scale,
                                  _plain_or(d.mean), _plain_or(d.std))

    def number(key: str) -> Any:
        return numbers()[key]

    for key in ("scale", "mean", "std"):
        run.fill(cfg, f"data.{key}", functools.partial(number, key))
    computed["normalization"] = {**numbers(), "dtype": str(report.dtype),
                                 "from": f"{len(report.scenes['train'])} training scenes"}
    log.info("data.scale/mean/std=auto for %s imagery: scale %.6g, mean %s, std %s",
             report.dtype, numbers()["scale"], numbers()["mean"], numbers()["std"])


def _sample_json(reader: RasterReader) -> Any:
    return sample_sums(reader).to_json()


def training_sample(cfg: DictConfig, report: PreflightReport) -> BandSums:
    """Band sums of a spread sample of the training scenes (cached with the preflight)."""
    d = cfg.data
    cache = FactCache(Path(d.root) / CACHE_NAME)
    total: BandSums | None = None
    for scene in report.scenes["train"]:
        with RasterReader(scene.image, nodata=d.nodata) as r:
            part = BandSums.from_json(cache.facts(scene.image, f"sample:{d.nodata}",
                                                  functools.partial(_sample_json, r)))
        total = part if total is None else total + part
    cache.save()
    assert total is not None
    return total


def record_training_data(cfg: DictConfig, report: PreflightReport,
                         computed: dict[str, Any]) -> None:
    """What the model was trained on, for the checks of ``seg-predict`` and the model card.

    ``computed.input``: the imagery's sample type and its typical high (the largest band's
    mean + 3 std in raw units, of the training sample); ``computed.data_fingerprint``: the
    SHA-256 of every split's scene names and file sizes.
    """
    mean, std = training_sample(cfg, report).mean_std()
    computed["input"] = {"dtype": str(report.dtype),
                         "high": round(float(np.max(mean + 3 * std)), 6)}
    h = hashlib.sha256()
    for split in sorted(report.scenes):
        for scene in report.scenes[split]:
            sizes = [p.stat().st_size for p in (scene.image, scene.mask) if p is not None]
            h.update(f"{split}/{scene.image.name}:{sizes}\n".encode())
    computed["data_fingerprint"] = f"sha256:{h.hexdigest()}"


def _plain_or(value: Any) -> Any:
    return value if isinstance(value, str) else list(value)


def check_grids(cfg: DictConfig, fp: Footprint, report: PreflightReport) -> None:
    """Every grid the run walks (validation; training in grid mode) fits its scenes."""
    t = cfg.tiling
    splits = ["val"] + (["train"] if t.mode == "grid" else [])
    key = f"tiling.q={t.q}" if t.q else f"tiling.tile_size={t.tile_size}"
    for split in splits:
        for scene in report.scenes[split]:
            h, w = report.shapes[scene.image]
            try:
                make_grid(h, w, fp, q=t.q, tile_size=None if t.q else t.tile_size)
            except TilingError as exc:
                raise ConfigError(f"{key} cannot tile {split} scene '{scene.image}' ({h}x{w}, "
                                  f"halo {fp.halo}, alignment {fp.align}): {exc}") from exc
