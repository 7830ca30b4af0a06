"""The portable model format: weights as safetensors, a JSON card, a checksum of each part.

``seg-export run=<run folder> output=<name>.segmodel`` (or ``output=<folder>``) writes what
prediction needs and nothing else, so a model can be shared (a zoo entry, a paper's
artefact) without the run folder and without a pickle:

* ``weights.safetensors`` — the network's tensors (safetensors holds no code);
* ``card.json`` — the model family and its keys, the footprint (halo, alignment,
  padding), bands, classes, names and colours, the normalisation, the training imagery's
  sample type, the training data's fingerprint, the run's metrics, the project version
  (see :func:`seg_at_scale.models.trained.card_of_run`);
* ``SHA256SUMS`` — the SHA-256 of the two parts, in ``sha256sum``'s format (a folder
  checks with ``sha256sum -c SHA256SUMS``).

A ``.segmodel`` file is a zip archive of those three files (stored, not compressed);
anything else is a folder of them. Reading checks every checksum first: a flipped byte is
refused naming the part. ``seg-predict model=<it>`` then predicts exactly as
``seg-predict run=<the run>`` does (byte-identical outputs).

A model file is checked before it is trusted, each refusal one line naming the part or key:

* before any part is read, the archive's members: only the three parts, each stored
  (uncompressed, so no member can declare more bytes than the file holds: no zip bomb),
  the card at most :data:`MAX_CARD_BYTES`, the checksums at most :data:`MAX_SUMS_BYTES`,
  the weights the size the card records; parts are hashed as they stream in;
* before the network is built, the card's architecture sizes (widths, depths, classes,
  bands: :data:`MODEL_BOUNDS`) and footprint; then the network is built on the ``meta``
  device (nothing allocated) and must fit the weights' shapes;
* once built, what the network itself determines: its footprint (halo, alignment,
  padding), its input bands and its classes must be what the card says (a smaller halo, a
  wrong padding or a wrong class count would give wrong tiles or labels silently).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import nn

from seg_at_scale.errors import InputError, SegAtScaleError
from seg_at_scale.io.writer import check_output_path
from seg_at_scale.models.card import ModelCard
from seg_at_scale.models.contract import ApproximateFootprint
from seg_at_scale.models.registry import build_model, for_prediction
from seg_at_scale.models.trained import CARD_FORMAT, TrainedModel, load_weights, weights_mismatch
from seg_at_scale.tiling.geometry import Footprint
from seg_at_scale.tiling.halo import footprint as measured_footprint
from seg_at_scale.tiling.halo import footprint_misfit

__all__ = ["write_model", "read_model", "read_card", "PARTS", "SUFFIX", "MAX_CARD_BYTES",
           "MAX_SUMS_BYTES", "MODEL_BOUNDS"]

WEIGHTS, CARD, SUMS = "weights.safetensors", "card.json", "SHA256SUMS"
PARTS = (CARD, WEIGHTS)
SUFFIX = ".segmodel"

MAX_CARD_BYTES = 4 << 20  # names and colours of 254 classes take a few kB
MAX_SUMS_BYTES = 4 << 10  # two lines
_MAX_BYTES = {CARD: MAX_CARD_BYTES, SUMS: MAX_SUMS_BYTES}
_CHUNK = 1 << 20
_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated",
            zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "lzma"}

MAX_CLASSES = 254  # labels are uint8 and 255 marks no data (seg_at_scale.data.config)
MAX_BANDS = 1024
MAX_WIDTH = 4096
MAX_DEPTH = 12
MAX_COUNT = 64
MAX_KERNEL = 31
MAX_OTHER = 4096  # any other whole number in the model's keys (rates, band indices)
MAX_ALIGN = 1 << 12
MAX_HALO = 1 << 16
MAX_NESTING = 8  # mappings within the model's keys (smp's options)
#: The inclusive range of each architecture key a card's ``model`` may hold (in a list, each
#: item's); any other whole number is within +-MAX_OTHER. The network's own checks follow.
MODEL_BOUNDS: dict[str, tuple[int, int]] = {
    **dict.fromkeys(("in_channels", "planes"), (1, MAX_BANDS)),
    "num_classes": (1, MAX_CLASSES),
    **dict.fromkeys(("base_width", "initial_filters", "stem_width", "aspp_width",
                     "decoder_width", "bottleneck_deepest", "widths", "shape_widths",
                     "decoder_channels"), (1, MAX_WIDTH)),
    **dict.fromkeys(("levels", "depth", "encoder_depth"), (1, MAX_DEPTH)),
    **dict.fromkeys(("convs_per_level", "blocks_per_layer", "blocks_deepest", "blocks"),
                    (0, MAX_COUNT)),
    **dict.fromkeys(("initial_kernel", "deepest_kernel"), (1, MAX_KERNEL)),
}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _parts(trained: TrainedModel) -> dict[str, bytes]:
    state = {k: v.detach().cpu().contiguous().clone()
             for k, v in trained.model.state_dict().items()}
    weights = save_tensors(state, metadata={"format": CARD_FORMAT})
    card = {**trained.card.raw, "weights": {"file": WEIGHTS, "tensors": len(state),
                                        "bytes": len(weights)}}
    files = {CARD: (json.dumps(card, indent=2, allow_nan=False) + "\n").encode(),
             WEIGHTS: weights}
    files[SUMS] = "".join(f"{_sha256(files[p])}  {p}\n" for p in PARTS).encode()
    return files


def write_model(trained: TrainedModel, output: str | os.PathLike[str], *,
                overwrite: bool = False) -> Path:
    """Write ``trained`` as a ``.segmodel`` file or a folder (see the module docstring).

    Written under a temporary name beside ``output`` and renamed when complete.

    Raises:
        OutputExistsError: ``output`` exists and ``overwrite`` is off.
    """
    out = check_output_path(output, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    files = _parts(trained)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        if out.suffix == SUFFIX:
            target = tmp / out.name
            with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as zf:
                for name, data in files.items():
                    zf.writestr(name, data)
        else:
            target = tmp / "model"
            target.mkdir()
            for name, data in files.items():
                (target / name).write_bytes(data)
        if out.is_dir() and not out.is_symlink():
            shutil.rmtree(out)
        os.replace(target, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _run_instead(path: Path) -> str | None:
    """What to give for a training run's folder or checkpoint given as ``model=``."""
    for run in (path, *list(path.parents)[:2]):
        if (run / "run_config.yaml").is_file():
            if path.suffix == ".ckpt":
                return f"it is a checkpoint of the run '{run}': give run={run} ckpt={path.name}"
            return f"it is the training run '{run}': give run={run}"
    if path.suffix == ".ckpt":
        return ("it is a checkpoint: give run=<the folder of its training run> "
                f"ckpt={path.name}, or export that run with seg-export")
    return None


def _not_a_model(path: Path, exc: BaseException) -> InputError:
    return InputError(f"model='{path}' is not a model file made by seg-export ({exc}); "
                      "give a .segmodel file or folder, or run=<training run folder>")


def _zip_members(path: Path, zf: zipfile.ZipFile) -> dict[str, int]:
    """The archive's parts and their sizes, every member checked before any is read.

    Only the three parts, once each, unencrypted and stored: a stored member's declared size
    is the bytes it takes in the file, so together they cannot declare more than the file
    holds (a compressed member may declare gigabytes from a few kB: a zip bomb).
    """
    sizes: dict[str, int] = {}
    for info in zf.infolist():
        name = info.filename
        if name not in (*PARTS, SUMS):
            raise InputError(f"model='{path}' holds {name!r}, which seg-export does not write "
                             f"(only {CARD}, {WEIGHTS} and {SUMS}); get the model again "
                             "from its source")
        if name in sizes:
            raise InputError(f"model='{path}' holds {name} twice: it was not made by "
                             "seg-export; get the model again from its source")
        if info.flag_bits & 0x1:
            raise InputError(f"model='{path}': {name} is encrypted: it was not made by "
                             "seg-export; get the model again from its source")
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            raise InputError(f"model='{path}': {name} declares {info.file_size} bytes from "
                             f"{info.compress_size} in the file ("
                             f"{_METHODS.get(info.compress_type, info.compress_type)}); "
                             "seg-export stores its parts "
                             "uncompressed, so it is not read: get the model again from its "
                             "source")
        sizes[name] = info.file_size
    total, held = sum(sizes.values()), path.stat().st_size
    if total > held:
        raise InputError(f"model='{path}': its parts declare {total} bytes but the file holds "
                         f"{held} (truncated or damaged); get the model again from its source")
    return sizes


@contextmanager
def _opened(path: Path) -> Iterator[tuple[dict[str, int], Callable[[str], IO[bytes]]]]:
    """The parts' sizes (as stored; nothing read yet) and a way to open each part."""
    if path.is_dir():
        sizes = {n: (path / n).stat().st_size for n in (*PARTS, SUMS) if (path / n).is_file()}
        yield sizes, lambda name: open(path / name, "rb")
        return
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise _not_a_model(path, exc) from None
    with zf:
        yield _zip_members(path, zf), zf.open


def _read_part(path: Path, opener: Callable[[str], IO[bytes]], name: str, size: int, *,
               keep: bool = True) -> tuple[str, bytes | None]:
    """A part's SHA-256 and (``keep``) its bytes; read in chunks, never past ``size``."""
    digest = hashlib.sha256()
    try:
        with opener(name) as f:
            if keep:
                data = f.read(size + 1)
                digest.update(data)
                got = len(data)
            else:
                data, got = None, 0
                while got <= size and (chunk := f.read(_CHUNK)):
                    got += len(chunk)
                    digest.update(chunk)
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise _not_a_model(path, exc) from None
    if got != size:
        raise InputError(f"model='{path}': {name} holds {'more' if got > size else 'fewer'} "
                         f"than the {size} bytes it declares (it changed while read, or is "
                         "damaged); get the model again from its source")
    return digest.hexdigest(), data


def _verified(path: Path, *, weights: bool) -> dict[str, bytes]:
    """The card (and, with ``weights``, the weights), every checksum and size checked first.

    A mismatch names the part. The members' declared sizes are checked before any is read
    (see :func:`_zip_members`); the weights' against the card's record of them before they
    are read; parts are hashed in chunks.
    """
    if not path.exists():
        raise InputError(f"model='{path}' does not exist; give a file or folder made by "
                         "seg-export")
    swapped = _run_instead(path)
    if swapped:
        raise InputError(f"model='{path}' is not a model made by seg-export: {swapped}")
    with _opened(path) as (sizes, opener):
        missing = [p for p in (*PARTS, SUMS) if p not in sizes]
        if missing:
            raise InputError(f"model='{path}' lacks {missing[0]}: it is not a complete model "
                             "made by seg-export; export it again")
        for name, most in _MAX_BYTES.items():
            if sizes[name] > most:
                raise InputError(f"model='{path}': {name} declares {sizes[name]} bytes, more "
                                 f"than the {most} it may hold; it was not made by seg-export: "
                                 "get the model again from its source")
        sums: dict[str, str] = {}
        _, text = _read_part(path, opener, SUMS, sizes[SUMS])
        for line in (text or b"").decode(errors="replace").splitlines():
            digest, _, name = line.partition("  ")
            sums[name.strip()] = digest.strip()

        def check(part: str, digest: str) -> None:
            if sums.get(part) != digest:
                raise InputError(f"model='{path}': {part} does not match its checksum in "
                                 f"{SUMS} (the file was changed or damaged in transit); get "
                                 "the model again from its source")

        digest, card = _read_part(path, opener, CARD, sizes[CARD])
        check(CARD, digest)
        files = {CARD: card or b""}
        recorded = _recorded_weights_bytes(files[CARD])
        if recorded is not None and recorded != sizes[WEIGHTS]:
            raise InputError(f"model='{path}': {WEIGHTS} declares {sizes[WEIGHTS]} bytes but "
                             f"{CARD} records weights.bytes={recorded}; get the model again "
                             "from its source")
        digest, data = _read_part(path, opener, WEIGHTS, sizes[WEIGHTS], keep=weights)
        check(WEIGHTS, digest)
        if data is not None:
            files[WEIGHTS] = data
    return files


def _recorded_weights_bytes(card: bytes) -> int | None:
    """The weights' size the card records (cards written before it was recorded: None)."""
    try:
        record = json.loads(card).get("weights")
    except (ValueError, AttributeError, RecursionError):
        return None  # refused with its reason once the card is read
    size = record.get("bytes") if isinstance(record, dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def read_card(path: Path) -> dict[str, Any]:
    """A model file's card, its checksums and sizes checked (the weights are not loaded)."""
    card, _ = _card_and_files(path, weights=False)
    return card


def _card_and_files(path: Path, *, weights: bool = True
                    ) -> tuple[dict[str, Any], dict[str, bytes]]:
    files = _verified(path, weights=weights)
    try:
        card: dict[str, Any] = json.loads(files[CARD])
    except (ValueError, RecursionError) as exc:
        raise InputError(f"model '{path}': {CARD} is not JSON ({exc}); export it "
                         "again") from None
    if not isinstance(card, dict) or card.get("format") != CARD_FORMAT:
        got = card.get("format") if isinstance(card, dict) else None
        raise InputError(f"model '{path}': {CARD} has format {got!r}, not "
                         f"{CARD_FORMAT!r}; export it again with this version")
    _check_card(card, f"model '{path}'")
    return card, files


def _edited(where: str, key: str, value: Any, rule: str) -> InputError:
    return InputError(f"{where}: {CARD} has {key}={value!r}, {rule}; the card was edited or "
                      "damaged: export the model again from its run")


def _whole(where: str, key: str, value: Any, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _edited(where, key, value, f"not a whole number in {low}..{high}")
    return value


def _section(where: str, card: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    node = card.get(key)
    if not isinstance(node, Mapping):
        raise _edited(where, key, node, "not a mapping of keys")
    return node


def _check_card(card: Mapping[str, Any], where: str) -> None:
    """The card's footprint, bands, classes and architecture sizes, before anything is built."""
    fp = _section(where, card, "footprint")
    if set(fp) != {"halo", "align", "padding", "out_residue"}:
        raise _edited(where, "footprint", dict(fp), "not the keys halo, align, padding, "
                      "out_residue")
    align = _whole(where, "footprint.align", fp["align"], 1, MAX_ALIGN)
    _whole(where, "footprint.halo", fp["halo"], 0, MAX_HALO)
    _whole(where, "footprint.out_residue", fp["out_residue"], 0, align - 1)
    if fp["padding"] not in ("same", "valid"):
        raise _edited(where, "footprint.padding", fp["padding"], "not 'same' or 'valid'")
    if not isinstance(card.get("exact", True), bool):
        raise _edited(where, "exact", card.get("exact"), "not true or false")
    data = _section(where, card, "data")
    _whole(where, "data.bands", data.get("bands"), 1, MAX_BANDS)
    k = _whole(where, "data.num_classes", data.get("num_classes"), 1, MAX_CLASSES)
    names = data.get("class_names")
    if not isinstance(names, list) or len(names) != k or not all(
            isinstance(n, str) for n in names):
        raise _edited(where, "data.class_names", names, f"not a list of data.num_classes={k} "
                      "names")
    _check_data(data, where, k, int(data["bands"]))
    _check_sizes(_section(where, card, "model"), where, "model")


def _check_data(data: Mapping[str, Any], where: str, k: int, bands: int) -> None:
    """What the predictor reads of the card's data besides bands and classes, each checked.

    The normalisation, ``ignore_index``, ``nodata``, the training imagery's ``input`` and the
    preview's ``colours``: an edited one failed in a traceback, some after the COG.
    """
    _whole(where, "data.ignore_index", data.get("ignore_index"), 0, 255)
    norm = data.get("normalization")
    if not isinstance(norm, Mapping):
        raise _edited(where, "data.normalization", norm, "not a mapping of keys")
    if not _number(norm.get("scale")) or not norm["scale"] > 0:
        raise _edited(where, "data.normalization.scale", norm.get("scale"), "not a number > 0")
    for key in ("mean", "std"):
        values = norm.get(key)
        if not isinstance(values, list) or len(values) not in (1, bands) or not all(
                _number(v) for v in values):
            raise _edited(where, f"data.normalization.{key}", values, f"not a list of 1 or "
                          f"data.bands={bands} numbers")
    nodata = data.get("nodata")
    if not (nodata is None or nodata == "nan" or _number(nodata)):
        raise _edited(where, "data.nodata", nodata, "not a number, 'nan' or null")
    seen = data.get("input")
    if seen is not None:
        dtype = seen.get("dtype") if isinstance(seen, Mapping) else None
        try:
            known = isinstance(dtype, str) and np.dtype(dtype).kind in "uif"
        except TypeError:
            known = False
        if not known or not (seen.get("high") is None or _number(seen["high"])):
            raise _edited(where, "data.input", seen, "not {dtype: a numpy sample type, high: "
                          "a number}")
    colours = data.get("colours")
    if colours is not None and (not isinstance(colours, list) or len(colours) != k or not all(
            isinstance(c, list) and len(c) in (3, 4) and all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 255 for v in c)
            for c in colours)):
        raise _edited(where, "data.colours", colours, f"not data.num_classes={k} colours of "
                      "3 or 4 values in 0..255")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_sizes(node: Mapping[str, Any], where: str, prefix: str, depth: int = 0) -> None:
    """Every whole number in the model's keys within :data:`MODEL_BOUNDS` (nested too)."""
    if depth > MAX_NESTING:
        raise _edited(where, prefix, "{...}", f"nested more than {MAX_NESTING} deep")
    for key, value in node.items():
        name = f"{prefix}.{key}"
        low, high = MODEL_BOUNDS.get(str(key), (-MAX_OTHER, MAX_OTHER))
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            at = name if i is None else f"{name}[{i}]"
            if isinstance(item, Mapping):
                _check_sizes(item, where, at, depth + 1)
            elif isinstance(item, int) and not isinstance(item, bool):
                _whole(where, at, item, low, high)


def _fits_weights(node: dict[str, Any], state: Mapping[str, Any], where: str,
                  trust: bool) -> None:
    """The network the card describes, built on the ``meta`` device, must fit the weights.

    Nothing is allocated, so a card describing a far larger network than its weights (every
    size within bounds, their product not) is refused before the real one is built.
    """
    try:
        with torch.device("meta"):
            skeleton = build_model(node, where=where, trust=trust)
    except SegAtScaleError:
        raise
    except Exception:  # noqa: BLE001 - a trusted network that cannot live on meta
        return  # built for real next, and its weights checked there
    mismatch = weights_mismatch(skeleton, state)
    if mismatch:
        raise InputError(f"{where}: the network {CARD} describes does not fit {WEIGHTS}: "
                         f"{mismatch}; the card was edited or belongs to other weights: "
                         "export the model again from its run")


def _network_footprint(model: nn.Module, exact: bool) -> Footprint:
    """The footprint the network itself has: exact, or its approximate one."""
    if exact:
        return measured_footprint(model)
    if isinstance(model, ApproximateFootprint):
        return model.approximate_footprint()
    return measured_footprint(model)


def _check_network(card: Mapping[str, Any], model: nn.Module, where: str) -> None:
    """What the network determines (bands, classes, footprint) must be what the card says.

    A card's halo may exceed the network's (more context is still exact) for same padding;
    a valid-padding network's halo is its shrink, which must match. With ``exact: false``
    the halo is the run's choice, so only alignment, padding and size rule are compared.
    """
    def refuse(key: str, value: Any, net: Any, what: str) -> InputError:
        return InputError(f"{where}: {CARD} has {key}={value!r} but the network has {net!r} "
                          f"({what}); the card was edited: export the model again from its "
                          "run")

    data = card["data"]
    for key, attr, what in (("data.bands", "in_channels", "its input bands, in_channels"),
                            ("data.num_classes", "num_classes", "its classes, num_classes")):
        net = getattr(model, attr, None)
        if isinstance(net, int) and not isinstance(net, bool) and net != data[key[5:]]:
            raise refuse(key, data[key[5:]], net, what)
    exact = bool(card.get("exact", True))
    fp, net_fp = card["footprint"], _network_footprint(model, exact)
    misfit = footprint_misfit(Footprint(**fp), net_fp, exact=exact)
    if misfit is not None:
        what = {"padding": "its padding", "align": "its downsampling factor, or a multiple",
                "out_residue": "its output sizes' residue",
                "halo": "its halo; tiles with less context are not exact"
                if fp["halo"] < net_fp.halo else "its halo, the per-side shrink"}[misfit]
        raise refuse(f"footprint.{misfit}", fp[misfit], getattr(net_fp, misfit), what)


def read_model(path: str | os.PathLike[str], *, trust: bool = False) -> TrainedModel:
    """A model file's network and card; checksums, sizes, card and registry checked first.

    The card's architecture sizes are bounded before anything is built; the network is
    built on the ``meta`` device first and must fit the weights; once built, its footprint,
    bands and classes must be the card's (see the module docstring).

    Raises:
        InputError: missing or extra parts, a compressed or oversized part, a checksum
            mismatch (naming the part), an unreadable card or weights file, a card key out
            of bounds or contradicting the network (naming the key, the card's value and
            the network's), weights that do not fit the card's model.
        ConfigError: a model family the registry does not know (unless ``trust``).
    """
    path = Path(path)
    card, files = _card_and_files(path)
    where = f"model '{path}'"
    node = for_prediction({k: v for k, v in card["model"].items() if k != "family"})
    try:
        state = load_tensors(files[WEIGHTS])
    except (SafetensorError, ValueError) as exc:
        raise InputError(f"{where}: {WEIGHTS} is not readable ({exc}); export it "
                         "again") from None
    _fits_weights(node, state, where, trust)
    model = build_model(node, where=where, trust=trust)
    load_weights(model, state, where)
    model.eval()
    _check_network(card, model, where)
    return TrainedModel(model, ModelCard.of(card), where)
