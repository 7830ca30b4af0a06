"""How to predict, as one frozen value validated once, before any rank starts.

``seg-predict`` has some twenty keys. Each is checked here, once, for its type and range,
and a bad one is refused naming the key, the value and the fix (``batch_size=0``,
``fast=maybe``, ``tta=foo`` and ``q=2.5`` were silently accepted or failed deep inside the
tile loop). The library takes the result: ``predict_raster(model, image, output,
PredictOptions(tile_size=2048))``, the way MONAI's ``SlidingWindowInferer`` holds its
settings apart from the data it runs on.

>>> PredictOptions(tile_size=512, fast=True).autocast
torch.bfloat16
>>> PredictOptions.from_mapping({"batch_size": 0})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
seg_at_scale.errors.ConfigError: batch_size=0: give tiles per forward pass as a whole number >= 1...
"""

from __future__ import annotations

import functools
import logging
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

import torch

from seg_at_scale.config_check import check_types, known_keys
from seg_at_scale.errors import ConfigError
from seg_at_scale.memory.precision import cpu_supports
from seg_at_scale.tiling.geometry import TileGrid, tiles_per_side

__all__ = ["PredictOptions", "default_batch_size", "native_bf16", "with_precision"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PredictOptions:
    """Settings of a prediction, shared by every scene it predicts.

    Attributes:
        tile_size: largest input window per tile (pixels); ``auto``: the largest the
            device's memory holds for this network, or the whole image as one tile
            (:mod:`seg_at_scale.tiling.auto_tile`); None with ``q``.
        q: tiles per side (wins over ``tile_size``); ``[rows, cols]`` for each axis its own
            (a strip 50,000 wide and 2,000 high: ``'q=[1,25]'``, quoted in a shell).
        batch_size: tiles per forward pass; None = 1 on CPU, ~16 Mpix on a GPU.
        fast: bf16 autocast + channels_last where the device has native bfloat16 kernels
            (a GPU of compute capability 8 or later, a CPU with AVX-512 BF16 or AMX), else
            float32, faster there than emulated bf16; False = the exact fp32 reference.
        tta: ``"flips"`` or ``"d4"``: exact test-time augmentation (mean softmax).
        probabilities: ``"uint8"`` (round(255 p)) or ``"float16"``: also write the softmax.
        nodata: the input's no-data value (overrides the file's tag); NaN allowed.
        resume: continue from the store of an interrupted run.
        overwrite: replace existing outputs.
        preview: draw a PNG of the labels over the image beside the output.
        progress: a progress bar on rank 0 (None: on unless ``CI`` is set).
        keep_store: keep the working Zarr store beside a ``.tif`` output.
        check_dtype: refuse an image whose sample type differs from the training data's.
        layout: the tiles' memory layout: ``channels_last`` (NHWC), ``contiguous`` (NCHW), or
            ``auto``: the faster of the two for this network on this device, timed once
            and kept in the user's cache (:mod:`seg_at_scale.prediction.layout_choice`);
            the labels are the same either way up to float rounding.
        staged: run an smp network stage by stage, each stage tiled over the whole scene's
            feature maps with its own halo (:mod:`seg_at_scale.tiling.staged.stages`): near the
            untiled forward's work instead of the whole network's halo on every tile. The
            maps live in files beside the output; one process; no TTA.
        stage_memory_mb: what one stage tile may hold, its input windows and the maps its
            forward holds at once, measured when the stages are planned (staged).
        fold_bn: fold every eval BatchNorm that follows a convolution into it
            (:mod:`seg_at_scale.models.fold`): the same function with one pass over the
            feature maps fewer (1.01-1.07x on CPU here); the logits differ from the
            network as written by float rounding, like the memory layout's.
        compile: ``torch.compile`` the network per input shape, each shape used only where
            its compiled output equals the eager one bit for bit (the same labels);
            ``auto``: where the forwards left save more than the compile costs, measured
            and kept in the user's cache (:mod:`seg_at_scale.prediction.compile_choice`).
        stac: write a STAC Item (``<name>.stac.json``) beside each output.
        vector_connectivity: polygons' pixel connectivity, 4 or 8 (vector outputs).
        vector_min_area: drop polygons smaller than this (CRS units, e.g. m²).
        vector_simplify: coverage-simplification tolerance (CRS units; 0 = pixel edges).
        vector_classes: polygonize only these class ids (None: all).
    """

    tile_size: int | Literal["auto"] | None = "auto"
    q: int | tuple[int, int] | None = None
    batch_size: int | None = None
    fast: bool = False  # exact by default: the fast path is asked for
    tta: Literal["flips", "d4"] | None = None
    probabilities: Literal["uint8", "float16"] | None = None
    nodata: float | None = None
    resume: bool = True
    overwrite: bool = False
    preview: bool = True
    progress: bool | None = None
    keep_store: bool = False
    check_dtype: bool = True
    layout: Literal["auto", "channels_last", "contiguous"] = "auto"
    staged: bool = False
    stage_memory_mb: int = 512
    fold_bn: bool = False
    compile: bool | Literal["auto"] = "auto"
    stac: bool = True
    vector_connectivity: Literal[4, 8] = 4
    vector_min_area: float = 0.0
    vector_simplify: float = 0.0
    vector_classes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_types("", {f.name: getattr(self, f.name) for f in fields(self)},
                    typing.get_type_hints(PredictOptions))
        tiles_per_side("q", self.q, "give tiles per side as a whole number >= 1 (1 = one "
                       "tile), [rows, cols] of such numbers, or q=null to tile by tile_size")
        if self.tile_size != "auto":
            _at_least("tile_size", self.tile_size, 1, "give the largest input window in "
                      "pixels, a whole number >= 1 (e.g. tile_size=1024), or auto")
        _at_least("batch_size", self.batch_size, 1, "give tiles per forward pass as a whole "
                  "number >= 1, or batch_size=null (1 on a CPU, about 16 Mpix on a GPU)")
        _at_least("stage_memory_mb", self.stage_memory_mb, 1, "give the megabytes of maps one "
                  "stage tile may hold, a whole number >= 1 (e.g. stage_memory_mb=512)")
        if self.q is None and self.tile_size is None:
            raise ConfigError("q and tile_size are both null: give tile_size=<pixels> (e.g. "
                              "1024) or q=<tiles per side>")
        bad = [c for c in self.vector_classes or () if not 0 <= c < 255]
        if bad:
            raise ConfigError(f"vector_classes={list(self.vector_classes or ())} holds {bad}: "
                              "give class ids 0..254 (255 is no data)")
        for key in ("vector_min_area", "vector_simplify"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"{key}={getattr(self, key)!r}: give a number >= 0 (CRS "
                                  "units; 0 = off)")
        if self.nodata is not None and math.isinf(self.nodata):
            raise ConfigError(f"nodata={self.nodata!r}: give a finite value or nan (infinite "
                              "samples are no data anyway)")

    @property
    def autocast(self) -> torch.dtype | None:
        """The autocast dtype of the fast path (None: fp32)."""
        return torch.bfloat16 if self.fast else None

    @property
    def channels_last(self) -> bool:
        """Whether tiles run in the channels-last (NHWC) memory layout."""
        return self.layout != "contiguous"

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> PredictOptions:
        """Options from config keys (unknown keys refused naming the nearest valid one)."""
        keys = known_keys("", values, [f.name for f in fields(cls)])
        for key in ("nodata", "vector_min_area", "vector_simplify"):
            if isinstance(keys.get(key), int) and not isinstance(keys[key], bool):
                keys[key] = float(keys[key])
        for key in ("vector_classes", "q"):
            if isinstance(keys.get(key), list):
                keys[key] = tuple(keys[key])
        return cls(**keys)

    @staticmethod
    def names() -> list[str]:
        """Every option's key, in declaration order."""
        return [f.name for f in fields(PredictOptions)]

    @classmethod
    def docs(cls) -> dict[str, str]:
        """Each option's one-line description, from the class docstring (``--help``)."""
        return field_docs(cls)


def field_docs(cls: type) -> dict[str, str]:
    """``{field: description}`` from a dataclass docstring's ``Attributes:`` section.

    The one place a key's meaning is written: ``seg-predict --help`` is made from it.

    >>> field_docs(PredictOptions)["fast"]  # doctest: +ELLIPSIS
    'bf16 autocast + channels_last where the device has native bfloat16 kernels (a GPU ...'
    >>> field_docs(PredictOptions)["q"].endswith("``'q=[1,25]'``, quoted in a shell).")  # joined
    True
    """
    import inspect
    import re

    doc = inspect.getdoc(cls) or ""
    body = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
    out: dict[str, str] = {}
    key = None
    for line in body.splitlines():
        m = re.match(r"^    (\w+): (.*)$", line)
        if m:
            key, out[m.group(1)] = m.group(1), m.group(2).strip()
        elif key is not None and line.startswith("        "):
            out[key] += " " + line.strip()
        elif line.strip() and not line.startswith(" "):
            break
    return {k: " ".join(v.split()) for k, v in out.items()}


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16 natively.

    A CUDA GPU of compute capability 8 or later (Ampere on); a CPU whose oneDNN has
    bfloat16 kernels (AVX-512 BF16, AMX); another backend as asked.
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return cpu_supports(torch.bfloat16)
    return True


def with_precision(options: PredictOptions, device: torch.device,
                   decide: Callable[[Callable[[], bool]], bool] | None = None
                   ) -> PredictOptions:
    """``options`` as ``device`` runs them: ``fast=true`` without native bfloat16 is float32.

    bfloat16 without native kernels is emulated: on a CPU with AVX2 alone (Intel before
    Cooper Lake, AMD before Zen 4) the demo's U-Net ran a 512 px tile in 2.4 s in bf16
    channels_last and 52 s contiguous, against 0.24 s in float32, so ``fast=true`` there is
    float32 (channels_last where ``layout=auto`` finds it faster): faster, and the labels
    closer to the exact reference. ``decide(fn)`` runs ``fn`` on one process and gives its
    answer to every process (every rank of a prediction computes in one precision); by
    default ``fn()``.
    """
    if not options.fast:
        return options
    native = decide(functools.partial(native_bf16, device)) if decide is not None else \
        native_bf16(device)
    if native:
        return options
    _say_float32(device.type)
    return replace(options, fast=False)


@functools.cache
def _say_float32(device: str) -> None:
    """Once per process and device type."""
    log.info("fast=true on a %s without native bfloat16 kernels: bfloat16 would be emulated, "
             "10x and more slower than float32 here, so the prediction runs in float32 (the "
             "exact path's precision)", "CPU" if device == "cpu" else f"{device} device")


def _at_least(key: str, value: int | None, low: int, fix: str) -> None:
    """Refuse ``value`` below ``low``, naming ``key`` and the value given."""
    if value is not None and value < low:
        raise ConfigError(f"{key}={value!r}: {fix}")


def default_batch_size(grid: TileGrid, device: torch.device | str) -> int:
    """Tiles per forward: 1 on CPU (no gain), else about 16 Mpix of input per batch."""
    if torch.device(device).type != "cuda":
        return 1
    area = grid.tiles[0].read.area
    return int(max(1, min(16, (16 << 20) // area)))
