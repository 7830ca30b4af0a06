"""The ``data`` and ``tiling`` config groups as validated, frozen values.

The training entry point turns each group into a dataclass here, before any work: a
value of the wrong type or range is refused naming the key, the value, the range and the
fix (``tiling.q=abc`` would otherwise surface as a ``TypeError`` deep in the grid code),
and unknown keys are refused naming the known ones.

The values come from ``conf/data/*.yaml`` and ``conf/tiling/*.yaml`` alone: a key every
YAML of the group sets has no default here (a group that lacks it is refused naming it);
the defaults below are only for keys most YAMLs leave out (``None`` = not given).

>>> grid = {"mode": "grid", "q": 2, "tile_size": None, "core_size": None,
...         "samples_per_epoch": None, "batch_size": 1, "halo": "auto", "augment": None}
>>> tiling_config(grid).q
2
>>> tiling_config({**grid, "q": 0})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
seg_at_scale.errors.ConfigError: tiling.q=0: give the tiles per side as a whole number >= 1 ...
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any

from seg_at_scale.config_check import known_keys
from seg_at_scale.errors import ConfigError
from seg_at_scale.tiling.geometry import tiles_per_side

__all__ = ["DataConfig", "TilingConfig", "data_config", "tiling_config", "AUTO"]

AUTO = "auto"
MAX_CLASSES = 255  # predictions are uint8 and 255 marks no-data


def _whole(key: str, value: Any, low: int, fix: str, *, none: bool = False,
           auto: bool = False) -> Any:
    """``value`` if it is an int >= ``low`` (or None / 'auto' where allowed)."""
    if (none and value is None) or (auto and value == AUTO):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{key}={value!r}: {fix}")
    return value


def _number(key: str, value: Any, fix: str, *, positive: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (positive and value <= 0):
        raise ConfigError(f"{key}={value!r}: {fix}")
    return float(value)


def _known(group: str, values: Mapping[str, Any], cls: type) -> dict[str, Any]:
    """``values`` without Hydra's own keys; unknown and missing keys refused by name."""
    return known_keys(group, values, [f.name for f in fields(cls)],
                      required=[f.name for f in fields(cls) if f.default is MISSING
                                and f.default_factory is MISSING])


@dataclass(frozen=True)
class TilingConfig:
    """What the ``tiling`` group sets (see ``conf/tiling/*.yaml``)."""

    mode: str
    q: int | tuple[int, int] | None
    tile_size: int | str | None
    core_size: int | None
    samples_per_epoch: int | None
    batch_size: int
    halo: int | str
    augment: Mapping[str, Any] | None
    exact: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.exact, bool):
            raise ConfigError(f"tiling.exact={self.exact!r}: use true (halo tiling equal to "
                              "the whole-image forward) or false (approximate halo tiles, "
                              "for networks that need the whole input)")
        if self.mode not in ("grid", "random"):
            raise ConfigError(f"tiling.mode={self.mode!r}: use 'grid' (exact whole-image "
                              "gradient) or 'random' (random aligned tiles)")
        q_fix = ("give the tiles per side as a whole number >= 1 (1 = the whole image in one "
                 "tile), [rows, cols] of such numbers, or tiling.q=null with "
                 "tiling.tile_size=<pixels>")
        tiles_per_side("tiling.q", self.q, q_fix)
        _whole("tiling.tile_size", self.tile_size, 1, "give the largest input window in "
               "pixels (a whole number >= 1, e.g. 512), 'auto' (the largest tile within "
               "memory.budget_gb) or null with tiling.q=<tiles per side>", none=True, auto=True)
        if self.q is None and self.tile_size is None:
            raise ConfigError("tiling.q and tiling.tile_size are both null: give tiles per "
                              "side (tiling.q=2) or a window size (tiling.tile_size=512)")
        _whole("tiling.batch_size", self.batch_size, 1, "give tiles per batch as a whole "
               "number >= 1")
        _whole("tiling.halo", self.halo, 0, "use 'auto' (the model's receptive field) or a "
               "whole number of pixels >= 0", auto=True)
        if self.augment is not None:
            _check_augment(self.augment)
        if self.mode == "grid":  # each whole image by q / tile_size, one at a time
            for key, value, quiet in (("core_size", self.core_size, None),
                                      ("samples_per_epoch", self.samples_per_epoch, None),
                                      ("batch_size", self.batch_size, 1)):
                if value != quiet:
                    raise ConfigError(
                        f"tiling.{key}={value!r} is for tiling=random (random tiles), and this "
                        "run tiles by tiling=grid (which experiment=finetune also chooses): "
                        "each whole image in tiling.q x tiling.q tiles (or tiles of "
                        f"tiling.tile_size), one image per step; leave tiling.{key} out, or "
                        "train on random tiles with tiling=random")
        if self.mode == "random":
            _whole("tiling.core_size", self.core_size, 1, "give the output side of a random "
                   "training tile in pixels (a whole number >= 1, e.g. 128)", none=True)
            _whole("tiling.samples_per_epoch", self.samples_per_epoch, 1, "give random tiles "
                   "per epoch as a whole number >= 1", none=True)


def _check_augment(values: Mapping[str, Any]) -> None:
    """``tiling.augment``: the keys of :func:`~seg_at_scale.data.transforms.build_augment`.

    Checked with the group, not when the first training batch builds the transforms
    (albumentations' validation dump, after the run had started).
    """
    from seg_at_scale.data.transforms import build_augment

    known_keys("tiling.augment", values, list(inspect.signature(build_augment).parameters))
    for key, v in values.items():
        name = f"tiling.augment.{key}"
        if key in ("flips", "rotate90") and not isinstance(v, bool):
            raise ConfigError(f"{name}={v!r}: use true or false")
        if key in ("brightness", "contrast", "noise_std"):
            _number(name, v, "give a limit >= 0 (0: off)")
            if v < 0:
                raise ConfigError(f"{name}={v!r}: give a limit >= 0 (0: off)")
        if key == "p" and not (_number(name, v, "give a probability, 0..1") <= 1 and v >= 0):
            raise ConfigError(f"{name}={v!r}: give a probability, 0..1")
        if key == "seed":
            _whole(name, v, 0, "give a whole number >= 0, or null", none=True)


def check_class_weight_power(power: Any) -> None:
    """``data.class_weight_power``: a number >= 0 or null.

    Checked before ``data.class_weights`` is resolved from it: a resolver's error reached
    the user as OmegaConf's traceback.
    """
    if power is not None and (isinstance(power, bool) or not isinstance(power, int | float)
                              or not power >= 0):
        raise ConfigError(f"data.class_weight_power={power!r}: give a number >= 0 (1: every "
                          "class present the same total weight, 0.5: softer, 0: none) or null")


def tiling_config(values: Mapping[str, Any]) -> TilingConfig:
    """The ``tiling`` group as a :class:`TilingConfig`; refuses unknown keys and bad values.

    ``q`` given as a list (``tiling.q=[1,4]``: rows, cols) becomes a tuple.
    """
    known = _known("tiling", values, TilingConfig)
    if isinstance(known.get("q"), list):
        known["q"] = tuple(known["q"])
    return TilingConfig(**known)


@dataclass(frozen=True)
class DataConfig:
    """What the ``data`` group sets (see ``conf/data/*.yaml``).

    ``scale``, ``mean`` and ``std`` may be ``'auto'``: worked out from the training
    split's dtype and band statistics (:mod:`seg_at_scale.data.band_stats`).
    """

    root: str
    bands: int
    num_classes: int
    class_names: Sequence[str] | None
    ignore_index: int
    nodata: float | None
    scale: float | str
    mean: Sequence[float] | str
    std: Sequence[float] | str
    class_weights: Sequence[float] | None
    num_workers: int
    synthetic: Mapping[str, Any]
    class_weight_power: float | None = None  # the power behind class_weights (a sweep axis)
    mask_bands: int = 1  # label bands per mask: 1, or one per detector plane (cosmic)

    def __post_init__(self) -> None:
        _whole("data.bands", self.bands, 1, "give the image bands (channels) per pixel, e.g. 4")
        _whole("data.num_classes", self.num_classes, 1, f"give the number of classes, 1.."
               f"{MAX_CLASSES - 1}")
        if self.num_classes >= MAX_CLASSES:
            raise ConfigError(f"data.num_classes={self.num_classes}: at most {MAX_CLASSES - 1} "
                              f"classes (predictions are uint8, {MAX_CLASSES} = no-data)")
        _whole("data.ignore_index", self.ignore_index, 0, "give the label that carries no "
               "loss (255 by convention)")
        if self.ignore_index < self.num_classes:
            raise ConfigError(f"data.ignore_index={self.ignore_index} is one of the classes "
                              f"0..{self.num_classes - 1} (data.num_classes={self.num_classes}):"
                              " the label that carries no loss lies outside them; give 255 (the"
                              f" convention) or another label >= {self.num_classes}")
        _whole("data.num_workers", self.num_workers, 0, "give data-loader processes, >= 0")
        _whole("data.mask_bands", self.mask_bands, 1, "give label bands per mask, >= 1")
        if self.nodata is not None and not (isinstance(self.nodata, float)
                                            and math.isnan(self.nodata)):
            _number("data.nodata", self.nodata, "give the images' no-data value, nan, or null")
        if self.scale != AUTO:
            _number("data.scale", self.scale, "give a positive factor (1/255 for uint8) or "
                    "'auto' (from the dtype and the training data)", positive=True)
        for key in ("mean", "std"):
            self._check_per_band(key)
        if self.class_weights is not None and len(self.class_weights) != self.num_classes:
            raise ConfigError(f"data.class_weights has {len(self.class_weights)} values but "
                              f"data.num_classes={self.num_classes}: give one weight per class "
                              "or null")

    def _check_per_band(self, key: str) -> None:
        values = getattr(self, key)
        if values == AUTO:
            return
        fix = (f"give one value, or one per band ({self.bands}), or 'auto' (per-band "
               "statistics of the training data)")
        if isinstance(values, str) or not isinstance(values, Sequence):
            raise ConfigError(f"data.{key}={values!r}: {fix}")
        if len(values) not in (1, self.bands):
            raise ConfigError(f"data.{key} has {len(values)} values for data.bands="
                              f"{self.bands}: {fix}")
        for band, v in enumerate(values):
            _number(f"data.{key}", v, fix)
            if key == "std" and v <= 0:
                raise ConfigError(f"data.std has {v} for band {band}: a standard deviation "
                                  "divides the band, so it must be > 0; give the band's spread "
                                  "(e.g. 0.25) or data.std=auto")


def data_config(values: Mapping[str, Any]) -> DataConfig:
    """The ``data`` group as a :class:`DataConfig`; refuses unknown keys and bad values."""
    return DataConfig(**_known("data", values, DataConfig))
