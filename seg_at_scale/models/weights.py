"""Pretrained weights from a file: read without running code, matched by key, reported.

``read_weights(path)`` reads ``.safetensors`` (safetensors) or ``.pth`` / ``.pt`` /
``.ckpt`` / ``.bin`` (``torch.load(weights_only=True)``: plain tensors and containers only,
a pickled object is refused, never run). Lightning checkpoints and training checkpoints
are unwrapped (``state_dict``, ``model``, ``module``). :func:`match_weights` then maps the
file's keys onto a module's: a common prefix of the file (``backbone.``, ``encoder_q.``,
``model.net.encoder.`` of a Lightning checkpoint, ...) is found by trying each and keeping
the one that matches most tensors; timm's feature-extractor names (``stem_0`` for
``stem.0``) and smp's ``model.`` wrapper of timm encoders are tried too, so one timm,
torchvision or torchgeo state dict loads into ``resnet34`` and ``tu-resnet34`` alike.
A file is refused when it leaves tensors of the module missing, holds tensors the module
has no place for beyond the pretraining task's head (``fc.*``, ``head.*``, ...: another
network, e.g. resnet34's file for resnet18), or holds NaN or infinite values.

**Hub names** (``imagenet``, ``hf-hub:org/name``) are taken from the local Hugging Face
cache, else downloaded; whether the machine is offline is decided once per process, in
at most :data:`HUB_TIMEOUT_S` (:func:`is_offline`), and entry points ask it before any work
(:func:`check_hub_name`).

**The first convolution** (``band_map``): input band ``i`` of the model takes the file's
input channel ``band_map[i]``; a band mapped to ``null`` starts at zero. Without a band
map, band ``i`` takes channel ``i`` while the file has one, and the bands past the file's
channels start at zero. So a model given zeros on its extra bands computes exactly what
the pretrained network computes on the mapped bands.

**Normalisation**: the weights' own (ImageNet mean/std, torchgeo per-band statistics) is
read from the safetensors header (``mean``, ``std``, ``scale`` as JSON), a sidecar
``<file>.json`` or a Hugging Face ``config.json`` beside the file (timm's
``pretrained_cfg``), or from a run's checkpoint (the data normalisation its network was
trained with, which the run records); it is recorded per input band, through the band map.

>>> match = match_weights({"backbone.conv.weight": torch.zeros(2, 3, 1, 1)},
...                       {"conv.weight": torch.zeros(2, 3, 1, 1)}, first_conv="conv.weight")
>>> match.prefix, match.keys
('backbone.', {'conv.weight': 'backbone.conv.weight'})
>>> adapt_first_conv(torch.ones(1, 3, 1, 1), 4, [2, None, 0, 1])[0, :, 0, 0].tolist()
[1.0, 0.0, 1.0, 1.0]
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from seg_at_scale.config_check import check_local
from seg_at_scale.errors import ConfigError, InputError
from seg_at_scale.models.checkpoint import MEANING_KEY, PICKLED_GLOBAL, UNREADABLE

__all__ = ["read_weights", "match_weights", "WeightsMatch", "adapt_first_conv",
           "normalization_of", "is_offline", "resolve_weights", "WEIGHT_SUFFIXES",
           "load_weights", "Loaded", "band_normalization", "is_hub_name", "check_hub_name",
           "HEAD_NAMES", "HUB_TIMEOUT_S"]

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".ckpt", ".bin")
_WRAPPERS = ("state_dict", "model", "module", "model_state_dict", "net")
_TARGET_PREFIXES = ("", "model.")  # smp wraps a timm encoder as encoder.model
# The pretraining task's head, which an encoder has no place for: classifiers (timm's fc,
# head, classifier; torchvision's fc, classifier; pretrainedmodels' last_linear) and the
# layers timm's features_only drops after the last stage (EfficientNet's conv_head, bn2).
# A file's unused tensors outside these (a top-level name) are refused: another network.
HEAD_NAMES = frozenset({"fc", "_fc", "head", "heads", "classifier", "last_linear", "logits",
                        "conv_head", "bn2", "fc_norm", "pre_logits", "head_drop"})
#: the module of a whole segmentation network that gives one channel per class (smp's)
CLASS_HEADS = frozenset({"segmentation_head"})
HUB_TIMEOUT_S = 2.0  # how long the hub may take to answer before the machine counts offline
_HUB_PROBE: dict[str, bool] = {}  # the probe's answer, per endpoint: asked once per process
# what torch.load raises on a file that is not one (text: KeyError, a bad zip, ...), as
# seg_at_scale.models.checkpoint catches


def read_weights(path: str | os.PathLike[str], *, key: str) -> tuple[dict[str, Tensor],
                                                                      dict[str, str]]:
    """The tensors of a weights file and its metadata (safetensors header), as plain data.

    Args:
        path: the file.
        key: the config key that named it, for messages (``model.encoder_weights``).

    Raises:
        InputError: missing, unreadable, holding Python objects, or holding no tensors.
    """
    check_local(f"{key}='{path}'", str(path), error=InputError)
    p = Path(path)
    if not p.is_file():
        raise _not_a_file(p, key)
    if p.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(p), framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
        except Exception as exc:  # safetensors raises its own error types
            raise InputError(f"{key}='{p}' is not a readable safetensors file ({exc}); "
                             "save it again with safetensors.torch.save_file") from None
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = PICKLED_GLOBAL.search(str(exc))  # as checkpoints: the global it asks for
        if found is None:  # "invalid load key": text, HTML, not a pickle at all
            raise _unreadable(p, key, exc) from None
        raise InputError(f"{key}='{p}' holds a Python object ({found.group(1)}) that "
                         "loading would run; refused. Save its state_dict() alone "
                         "(torch.save(model.state_dict(), ...)) or as .safetensors") from None
    except UNREADABLE as exc:
        raise _unreadable(p, key, exc) from None
    return _tensors(obj, p, key), _trained_normalization(obj)


def _trained_normalization(obj: Any) -> dict[str, str]:
    """The normalisation a run's checkpoint records its network was trained with.

    As header strings (``{"mean", "std", "scale"}``); ``{}`` for any other file.
    """
    meaning = obj.get(MEANING_KEY) if isinstance(obj, Mapping) else None
    data = meaning.get("data") if isinstance(meaning, Mapping) else None
    norm = data.get("normalization") if isinstance(data, Mapping) else None
    if not isinstance(norm, Mapping) or not {"mean", "std"} <= set(norm):
        return {}
    bands = data.get("bands") if isinstance(data, Mapping) else None
    out = {k: norm[k] for k in ("mean", "std", "scale") if k in norm}
    for k in ("mean", "std"):  # one value stands for every band
        if isinstance(out[k], list) and len(out[k]) == 1 and isinstance(bands, int):
            out[k] = out[k] * bands
    return {k: json.dumps(v) for k, v in out.items()}


def _unreadable(path: Path, key: str, exc: BaseException) -> InputError:
    with path.open("rb") as f:
        head = f.read(16)
    if not head:
        reason = "it is empty"
    elif head[:1] == b"\x80":  # a pickle's PROTO opcode: pickle.dump, not torch.save
        return InputError(f"{key}='{path}' is a pickle not written by torch.save (pickle.dump),"
                          " which torch cannot load as plain data; save the state dict with "
                          "torch.save(state_dict, path) or safetensors.torch.save_file")
    elif isinstance(exc, KeyError | pickle.UnpicklingError):  # torch's text is no help here
        reason = f"neither a zip nor a pickle: it begins {head!r}"
    elif head[:2] == b"PK":  # torch.save's zip, cut short or damaged (miniz's own words)
        reason = f"a torch.save zip that is truncated or damaged: {_first_clause(exc)}"
    else:
        reason = _first_clause(exc)
    return InputError(f"{key}='{path}' is not a readable PyTorch file ({reason}); give a "
                      "state dict saved with torch.save or a .safetensors file")


def _first_clause(exc: BaseException) -> str:
    """The first sentence of an error's text, whole (a library's advice after it dropped)."""
    text = (str(exc).strip().splitlines() or [""])[0]
    text = text.split(". ")[0].rstrip(".")
    if len(text) > 160:
        text = text[:160].rsplit(" ", 1)[0] + " ..."
    return text or type(exc).__name__


def _not_a_file(path: Path, key: str) -> InputError:
    what = "is a folder" if path.is_dir() else "does not exist"
    # "org/name" may be a hub repository; a name with a weights file's suffix is a path
    hub = (f" (a hub repository is written hf-hub:{path})" if str(path).count("/") == 1
           and not path.is_dir() and path.suffix.lower() not in WEIGHT_SUFFIXES else "")
    return InputError(f"{key}='{path}' {what}; give the path of a weights file "
                      f"({', '.join(WEIGHT_SUFFIXES)}){hub}")


def _tensors(obj: Any, path: Path, key: str) -> dict[str, Tensor]:
    """The flat ``name -> tensor`` dict inside a loaded file (wrappers unwrapped)."""
    for _ in range(3):
        if isinstance(obj, Mapping):
            inner = next((obj[w] for w in _WRAPPERS if isinstance(obj.get(w), Mapping)), None)
            if inner is not None and not any(isinstance(v, Tensor) for v in obj.values()):
                obj = inner
    if not isinstance(obj, Mapping):
        raise InputError(f"{key}='{path}' holds a {type(obj).__name__}, not a state dict; "
                         "save model.state_dict()")
    out = {str(k): v for k, v in obj.items() if isinstance(v, Tensor)}
    if not out:
        raise InputError(f"{key}='{path}' holds no tensors (keys {list(obj)[:5]}); give a "
                         "state dict")
    return out


@dataclass
class WeightsMatch:
    """How a file's tensors map onto a module's state dict.

    Attributes:
        prefix: the file's prefix that was stripped (``""`` for none).
        keys: target key -> file key, for every matched tensor of the same shape (the
            first convolution may differ in its input channels).
        missing: target keys the file does not provide.
        unexpected: file keys (under the prefix) that match nothing.
        mismatched: ``(target key, file shape, target shape)`` of same-named tensors whose
            shapes differ.
        ambiguous: other prefixes that match as many tensors, holding other values (two
            networks in one file); :func:`check_fit` refuses the file.
    """

    prefix: str
    keys: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    ambiguous: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: matched, missing, unexpected and mismatched counts with examples."""
        def some(xs: Sequence[Any]) -> str:
            return f" (e.g. {', '.join(str(x) for x in xs[:3])})" if xs else ""

        return (f"{len(self.keys)} tensors loaded, {len(self.missing)} missing"
                f"{some(self.missing)}, {len(self.unexpected)} unexpected"
                f"{some(self.unexpected)}, {len(self.mismatched)} of another shape"
                f"{some([m[0] for m in self.mismatched])}, file prefix {self.prefix!r}")


def _candidates(name: str) -> list[str]:
    flat = name.replace(".", "_", 1)  # timm's features_only flattens the top Sequential
    return [q + n for q in _TARGET_PREFIXES for n in (name, flat)]


def _prefixes(keys: Sequence[str], depth: int = 4) -> set[str]:
    out = {""}
    for k in keys:
        parts = k.split(".")
        for d in range(1, min(depth, len(parts) - 1) + 1):
            out.add(".".join(parts[:d]) + ".")
    return out


def match_weights(source: Mapping[str, Tensor], target: Mapping[str, Tensor], *,
                  first_conv: str | None = None) -> WeightsMatch:
    """Map ``source`` (a file's tensors) onto ``target`` (a module's state dict).

    Tries every prefix of the file's keys and keeps the one matching most tensors of the
    right shape (see the module docstring); ``first_conv`` may differ in dimension 1.
    Prefixes that tie with other tensors (MoCo's ``encoder_q.`` and ``encoder_k.``): the
    query encoder ``encoder_q`` when it is one of them, else the tie is recorded in
    :attr:`WeightsMatch.ambiguous` and :func:`check_fit` refuses the file.
    """
    matches = [_match_under(source, target, prefix, first_conv)
               for prefix in sorted(_prefixes(list(source)), key=lambda p: (len(p), p))]
    top = max(len(m.keys) for m in matches)
    best = [m for m in matches if len(m.keys) == top]
    query = [m for m in best if "encoder_q" in m.prefix.split(".")]
    if top and len(query) == 1:
        return query[0]
    if top == 0 or len(best) == 1:
        return best[0]
    tied: list[WeightsMatch] = []
    for m in best:
        if not any(_same_tensors(source, m, t) for t in tied):
            tied.append(m)  # the shortest prefix stands for those holding equal tensors
    tied[0].ambiguous = [m.prefix for m in tied[1:]]
    return tied[0]


def _same_tensors(source: Mapping[str, Tensor], a: WeightsMatch, b: WeightsMatch) -> bool:
    """Whether two matches load the same values (e.g. ``""`` and a duplicate prefix)."""
    return a.keys.keys() == b.keys.keys() and all(
        torch.equal(source[a.keys[k]], source[b.keys[k]]) for k in a.keys)


def _match_under(source: Mapping[str, Tensor], target: Mapping[str, Tensor], prefix: str,
                 first_conv: str | None) -> WeightsMatch:
    m = WeightsMatch(prefix)
    for name, t in source.items():
        if not name.startswith(prefix):
            continue
        hit = next((c for c in _candidates(name[len(prefix):]) if c in target), None)
        if hit is None or hit in m.keys:
            m.unexpected.append(name)
            continue
        want = tuple(target[hit].shape)
        same = tuple(t.shape) == want or (hit == first_conv and t.dim() == 4 and
                                          t.shape[0] == want[0] and t.shape[2:] == want[2:])
        if same:
            m.keys[hit] = name
        else:
            m.mismatched.append((hit, tuple(t.shape), want))
    found = set(m.keys) | {x[0] for x in m.mismatched}
    m.missing = [k for k in target if k not in found]
    return m


def adapt_first_conv(weight: Tensor, in_channels: int,
                     band_map: Sequence[int | None] | None) -> Tensor:
    """The first convolution's weight ``[O, in_channels, k, k]`` from the file's ``[O, C, k, k]``.

    Band ``i`` takes the file's channel ``band_map[i]`` (``None``: zeros); without a map,
    channel ``i`` while ``i < C``, zeros after (see the module docstring).
    """
    src = weight.shape[1]
    bands = list(band_map) if band_map is not None else [
        i if i < src else None for i in range(in_channels)]
    out = weight.new_zeros(weight.shape[0], in_channels, *weight.shape[2:])
    for i, j in enumerate(bands):
        if j is not None:
            out[:, i] = weight[:, j]
    return out


def band_normalization(norm: Mapping[str, Any], band_map: Sequence[int | None] | None,
                       file_channels: int | None, in_channels: int) -> dict[str, Any]:
    """The weights' normalisation per input band: ``{"mean", "std", "scale"}``.

    A band takes its pretrained channel's mean and std (``band_map``, or the same index
    while the file has that channel); a band the weights do not cover gets ``None``.
    """
    n = len(norm["mean"])
    bands = band_map if band_map is not None else [
        i if i < (file_channels or n) else None for i in range(in_channels)]
    covered = [j if j is not None and j < n else None for j in bands]
    scale = norm.get("scale")  # absent or null: inputs at the data's own scale
    return {"mean": [None if j is None else float(norm["mean"][j]) for j in covered],
            "std": [None if j is None else float(norm["std"][j]) for j in covered],
            "scale": None if scale is None else float(scale)}


def check_band_map(band_map: Sequence[int | None] | None, in_channels: int,
                   file_channels: int | None, *, key: str = "model.band_map") -> None:
    """Refuse a band map of the wrong length or naming channels the weights lack."""
    if band_map is None:
        return
    if len(band_map) != in_channels:
        raise ConfigError(f"{key}={list(band_map)} has {len(band_map)} entries for "
                          f"{in_channels} input bands; give one pretrained channel (or null) "
                          "per band")
    for j in band_map:
        if j is not None and (j < 0 or (file_channels is not None and j >= file_channels)):
            top = (file_channels or 1) - 1
            raise ConfigError(f"{key}={list(band_map)}: channel {j} is not one of the "
                              f"weights' {file_channels} input channels (0..{top}); name "
                              "existing channels or null")


def normalization_of(path: str | os.PathLike[str], metadata: Mapping[str, str]
                     ) -> dict[str, Any] | None:
    """The weights' input normalisation ``{"mean", "std"[, "scale"]}``, or None if unknown.

    ``mean`` / ``std`` are per pretrained input channel, for inputs scaled as ``scale``
    says (absent: the data's own scale, e.g. 1/255 for 8-bit imagery, as timm's ImageNet
    statistics assume).
    """
    p = Path(path)
    found: dict[str, Any] = {}
    where = (f"'{p}' (its safetensors header)" if p.suffix == ".safetensors"
             else f"'{p}' (the normalisation its run trained with)")
    if {"mean", "std"} <= set(metadata):
        found = {k: _json(metadata[k], where, k) for k in ("mean", "std", "scale")
                 if k in metadata}
    for side in (p.with_name(p.name + ".json"), p.with_name("config.json")):
        if not found and side.is_file():
            where = f"'{side}'"
            doc = _json(side.read_text(), where, None)
            doc = doc.get("pretrained_cfg", doc) if isinstance(doc, dict) else {}
            found = {k: doc[k] for k in ("mean", "std", "scale") if k in doc}
    if not {"mean", "std"} <= set(found):
        return None
    return _checked_normalization(found, where)


def _json(text: str, where: str, key: str | None) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        what = f"{key}={text[:40]!r}" if key else f"{text[:40]!r}..."
        raise InputError(f"{where}: {what} is not JSON; write the statistics as JSON (e.g. "
                         '"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225])') from None


def _checked_normalization(found: dict[str, Any], where: str) -> dict[str, Any]:
    """``mean`` / ``std`` as float lists of one length, ``scale`` a float (null: absent)."""
    for k in ("mean", "std"):
        v = found[k]
        if not isinstance(v, list) or not v or not all(
                isinstance(x, int | float) and not isinstance(x, bool) for x in v):
            raise InputError(f"{where}: {k}={v!r} is not a list of numbers; give one value "
                             "per pretrained input channel (e.g. [0.485, 0.456, 0.406])")
        found[k] = [float(x) for x in v]
    if len(found["mean"]) != len(found["std"]) or min(found["std"]) <= 0:
        raise InputError(f"{where}: mean={found['mean']} and std={found['std']} need one "
                         "value per input channel each, std above zero; correct them")
    scale = found.pop("scale", None)
    if scale is not None:
        if not isinstance(scale, int | float) or isinstance(scale, bool) or scale <= 0:
            raise InputError(f"{where}: scale={scale!r} is not a positive number; give the "
                             "factor the statistics assume (1/255 for 8-bit) or leave it out")
        found["scale"] = float(scale)
    return found


def is_offline(timeout: float = HUB_TIMEOUT_S) -> bool:
    """True when the Hugging Face hub cannot be reached (``HF_HUB_OFFLINE=1``: at once).

    Otherwise a TCP connection to the hub's host (``HF_ENDPOINT``, default huggingface.co)
    is tried once per process, name lookup included, for at most ``timeout`` seconds in
    all (a resolver that never answers would hold ``socket.create_connection`` for
    minutes: the attempt runs in a daemon thread that is abandoned at the deadline).
    """
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").lower() in ("1", "true", "yes", "on"):
            return True
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if endpoint not in _HUB_PROBE:
        _HUB_PROBE[endpoint] = not _reachable(endpoint, timeout)
    return _HUB_PROBE[endpoint]


def _reachable(endpoint: str, timeout: float) -> bool:
    """Whether ``endpoint``'s host accepts a connection within ``timeout`` seconds."""
    from urllib.parse import urlsplit

    url = urlsplit(endpoint)
    host = url.hostname or "huggingface.co"
    port = url.port or (80 if url.scheme == "http" else 443)
    answered: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            answered.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, name="seg-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered)


def is_hub_name(spec: str) -> bool:
    """Whether a weights value names hub weights (``imagenet``, ``org/name``), not a file.

    ``folder/name`` where ``folder`` is a folder here is a path (a missing file).
    """
    p = Path(spec).expanduser()
    local = "/" in spec and not spec.startswith("hf-hub:") and p.parent.is_dir()
    return not (p.exists() or local or p.suffix in WEIGHT_SUFFIXES
                or spec.startswith(("/", ".", "~")))


def _cached(spec: str, encoder: str) -> Path | None:
    """The hub name's ``model.safetensors`` in the local Hugging Face cache, if there."""
    repo = _hub_repo(spec, encoder)
    if repo is None:
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, "model.safetensors")
    return Path(found) if isinstance(found, str) and Path(found).is_file() else None


def check_hub_name(spec: str, encoder: str, *, key: str) -> None:
    """Refuse at once a hub name this machine cannot fetch (offline, not in the cache).

    Entry points call it before any work: the offline decision is made here, once
    (:func:`is_offline`, at most :data:`HUB_TIMEOUT_S`), not after data and model are built.

    Raises:
        ConfigError: a hub name on a machine without internet whose weights are not in
            the local Hugging Face cache.
    """
    if is_hub_name(spec) and _hub_repo(spec, encoder) is None:
        raise _no_such_name(spec, encoder, key)
    if is_hub_name(spec) and _cached(spec, encoder) is None and is_offline():
        raise _offline(spec, encoder, key)


def _no_such_name(spec: str, encoder: str, key: str) -> ConfigError:
    """Neither a file nor a name of the encoder's weights (a typo of either)."""
    names = weights_names(encoder)
    listed = f" (its names: {', '.join(names[:8])}{', ...' if len(names) > 8 else ''})" \
        if names else ""
    return ConfigError(f"{key}={spec!r} is no file here, and encoder {encoder!r} has no "
                       f"weights of that name{listed}; give the path of a weights file "
                       f"({', '.join(WEIGHT_SUFFIXES)}), one of its names, or a hub "
                       "repository (hf-hub:org/name)")


def weights_names(encoder: str) -> list[str]:
    """The names of the pretrained weights ``encoder`` offers (timm's tags, smp's keys)."""
    if encoder.startswith("tu-"):
        import timm

        base = encoder[3:].split(".")[0]
        tags = {n.split(".", 1)[1] for n in timm.list_pretrained(f"{base}.*")}
        return ["imagenet", *sorted(tags)] if tags else []
    from segmentation_models_pytorch.encoders import encoders

    return sorted(encoders.get(encoder, {}).get("pretrained_settings", {}))


def _offline(spec: str, encoder: str, key: str) -> ConfigError:
    return ConfigError(f"{key}={spec!r} is a hub name, but this machine is offline "
                       f"(HF_HUB_OFFLINE=1, or huggingface.co did not answer within "
                       f"{HUB_TIMEOUT_S:g} s) and the weights are not in the local Hugging "
                       "Face cache; download the weights where there is internet (e.g. `hf "
                       f"download {_hub_repo(spec, encoder) or '<repo>'} model.safetensors "
                       "config.json`) and pass the file: "
                       f"{key}=/path/to/model.safetensors")


def resolve_weights(spec: str, encoder: str, *, key: str) -> Path:
    """The local file a weights value names: a path, or a hub name (cached or downloaded).

    A hub name already in the local Hugging Face cache needs no network; otherwise it is
    downloaded when the machine is online.

    Raises:
        InputError: a path that does not exist.
        ConfigError: a hub name on a machine without internet (the fix: download, pass
            the path), or one the encoder does not offer.
    """
    p = Path(spec).expanduser()
    if not is_hub_name(spec):
        check_local(f"{key}='{spec}'", spec, error=InputError)
        if not p.is_file():
            raise _not_a_file(p, key)
        return p
    cached = _cached(spec, encoder)
    if cached is not None:
        return cached
    repo = _hub_repo(spec, encoder)
    if repo is None:
        raise _no_such_name(spec, encoder, key)
    if is_offline():
        raise _offline(spec, encoder, key)
    from huggingface_hub import hf_hub_download

    try:
        path = Path(hf_hub_download(repo, "model.safetensors"))
    except Exception as exc:  # noqa: BLE001 (the hub raises HTTP, OS and its own errors)
        reason = (str(exc).strip().splitlines() or [""])[0][:120] or type(exc).__name__
        raise ConfigError(f"{key}={spec!r}: downloading model.safetensors of {repo} from "
                          f"the Hugging Face hub failed ({reason}); download it where there "
                          f"is internet (`hf download {repo} model.safetensors config.json`) "
                          f"and pass the file: {key}=/path/to/model.safetensors") from None
    try:
        hf_hub_download(repo, "config.json")  # the normalisation, read beside the file
    except Exception:  # noqa: BLE001 (a repository without it: no recorded normalisation)
        pass
    return path


def _hub_repo(spec: str, encoder: str) -> str | None:
    """The Hugging Face repository a hub name means for ``encoder``, or None."""
    if spec.startswith("hf-hub:") or spec.count("/") == 1:
        return spec.removeprefix("hf-hub:")
    if encoder.startswith("tu-"):
        import timm

        name = encoder[3:] if "." in encoder[3:] or spec in ("imagenet", "true") else \
            f"{encoder[3:]}.{spec}"
        try:
            cfg = timm.models.get_pretrained_cfg(name)
        except Exception:  # timm raises several types for unknown names
            return None
        return cfg.hf_hub_id if cfg is not None else None
    from segmentation_models_pytorch.encoders import encoders

    settings = encoders.get(encoder, {}).get("pretrained_settings", {}).get(spec)
    return settings.get("repo_id") if settings else None


@dataclass(frozen=True)
class Loaded:
    """What :func:`load_weights` did.

    Attributes:
        report: one line: the file, tensors loaded, missing, unexpected, mismatched.
        normalization: the weights' own, per file channel (None: not recorded).
        file_channels: the file's input channels (None: no first convolution matched).
    """

    report: str
    normalization: dict[str, Any] | None
    file_channels: int | None


def load_weights(module: nn.Module, spec: str, *, key: str, encoder: str, in_channels: int,
                 band_map: Sequence[int | None] | None, named: str | None = None) -> Loaded:
    """Load a weights file (or hub name) into ``module``: matched, checked, reported.

    The module's first convolution taking ``in_channels`` is adapted by ``band_map``
    (:func:`adapt_first_conv`); every other tensor must fit. ``encoder`` names the
    pretrained network (a hub name's source); ``named`` is what the refusals call the
    module (``encoder resnet18`` unless given: ``backbone resnet50``).

    Raises:
        InputError: a file that does not fit (the first missing or mismatched key named,
            or tensors of another network beyond the pretraining head), or holding NaN or
            infinite values.
        ConfigError: a bad band map, or a hub name offline.
    """
    path = resolve_weights(spec, encoder, key=key)
    tensors, meta = read_weights(path, key=key)
    target = module.state_dict()
    first = first_conv_key(module, in_channels)
    match = match_weights(tensors, target, first_conv=first)
    check_fit(key, path, match, target, tensors, named or f"encoder {encoder}")
    file_channels = tensors[match.keys[first]].shape[1] if first in match.keys else None
    check_band_map(band_map, in_channels, file_channels)
    state = {k: tensors[f] for k, f in match.keys.items()}
    check_finite(key, path, {match.keys[k]: tensors[match.keys[k]]  # the module's order
                             for k in target if k in match.keys})
    if first in state:
        state[first] = adapt_first_conv(state[first], in_channels, band_map)
    module.load_state_dict(state, strict=False)
    log.info("%s=%s: %s", key, path, match.summary())
    return Loaded(f"{path}: {match.summary()}", normalization_of(path, meta), file_channels)


def first_conv_key(module: nn.Module, in_channels: int) -> str:
    """State-dict key of the first convolution that reads the input bands (or "")."""
    for name, m in module.named_modules():
        if isinstance(m, nn.Conv2d) and m.in_channels == in_channels:
            return f"{name}.weight"
    return ""


def check_fit(key: str, path: Any, match: WeightsMatch, target: Mapping[str, Tensor],
              tensors: Mapping[str, Tensor], named: str) -> None:
    """Refuse a file that does not fit the module, naming the first keys and shapes.

    Tensors the module has no place for are refused too, but for the pretraining task's
    head (:data:`HEAD_NAMES`): every key of resnet18 is in resnet34 at the same shape, so
    only resnet34's 96 extra tensors tell its file from resnet18's.
    """
    if match.ambiguous:
        raise InputError(f"{key}='{path}' holds several networks that fit {named} "
                         f"equally, under prefixes {[match.prefix, *match.ambiguous]}; save "
                         "the one you mean alone (its state dict, prefix stripped)")
    of = named.split(" ", 1)[-1]  # the network the file should hold
    params = [k for k in match.missing if not k.endswith("num_batches_tracked")]
    if match.mismatched and all(_top(k) in CLASS_HEADS for k, _, _ in match.mismatched):
        k, have, want = match.mismatched[0]  # a whole network's, trained for other classes
        raise InputError(f"{key}='{path}' holds a network of {have[0]} classes, and the model "
                         f"has {want[0]} ({k} is {list(have)} in the file, {list(want)} in "
                         f"the model): set data.num_classes={have[0]} to predict the file's "
                         f"classes, or give the file as model.encoder_weights to train a new "
                         f"head of {want[0]} classes on its encoder")
    if match.mismatched:
        k, have, want = match.mismatched[0]
        raise InputError(f"{key}='{path}' does not fit {named}: {k} is "
                         f"{list(have)} in the file but {list(want)} in the model "
                         f"({len(match.mismatched)} such); give weights of {of}")
    if params:
        shown = ", ".join(f"{k} {list(v.shape)}" for k, v in list(tensors.items())[:3])
        raise InputError(f"{key}='{path}' does not fit {named}: "
                         f"{len(params)} of {len(target)} tensors missing (first "
                         f"{params[0]} {list(target[params[0]].shape)}); the file's "
                         f"first keys are {shown}; give weights of {of} (timm, "
                         "torchvision or torchgeo layout)")
    extra = [k for k in match.unexpected if not _head(k[len(match.prefix):])]
    if extra:
        head = sorted({_top(k[len(match.prefix):]) for k in match.unexpected
                       if _head(k[len(match.prefix):])})
        besides = f" (besides its classifier head {', '.join(h + '.*' for h in head)})" \
            if head else ""
        raise InputError(f"{key}='{path}' does not fit {named}: {len(extra)} of its "
                         f"tensors{besides} have no place in it (e.g. "
                         f"{', '.join(_examples(extra))}): "
                         f"the weights of another or a larger network; give weights of "
                         f"{of}")


def _examples(keys: Sequence[str], n: int = 3) -> list[str]:
    """One key from each of the first ``n`` modules holding ``keys``, a weight if any.

    Sorted: the same examples for a file's .pth and .safetensors layouts.
    """
    blocks: dict[str, list[str]] = {}
    for k in sorted(keys):
        blocks.setdefault(k.rsplit(".", 2)[0], []).append(k)
    return [next((k for k in ks if k.endswith(".weight")), ks[0])
            for ks in list(blocks.values())[:n]]


def _top(name: str) -> str:
    """A key's top-level module, through smp's ``model.`` wrapper of timm encoders."""
    parts = name.split(".")
    return parts[1] if parts[0] == "model" and len(parts) > 2 else parts[0]


def _head(name: str) -> bool:
    """Whether a file key belongs to the pretraining task's head (:data:`HEAD_NAMES`)."""
    return _top(name) in HEAD_NAMES


def non_finite(tensors: Mapping[str, Tensor]) -> tuple[int, int, str] | None:
    """Tensors holding NaN or infinite values, float tensors, and the first (key: count)."""
    floats = {k: t for k, t in tensors.items() if t.is_floating_point()}
    bad = [(k, t) for k, t in floats.items() if not bool(torch.isfinite(t).all())]
    if not bad:
        return None
    k, t = bad[0]
    return len(bad), len(floats), f"{k}: {int((~torch.isfinite(t)).sum())} of {t.numel()} values"


def check_finite(key: str, path: Any, tensors: Mapping[str, Tensor]) -> None:
    """Refuse weights holding NaN or infinite values (they train to a loss of nan)."""
    bad = non_finite(tensors)
    if bad:
        raise InputError(f"{key}='{path}' holds NaN or infinite values in {bad[0]} of the "
                         f"{bad[1]} float tensors it loads (first {bad[2]}); training from "
                         "them gives a loss of nan; give an intact file (save or download it "
                         "again)")
