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
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from seg_at_scale.errors import InputError, OutputExistsError
from seg_at_scale.models.registry import build_model
from seg_at_scale.models.trained import CARD_FORMAT, TrainedModel, load_weights

__all__ = ["write_model", "read_model", "read_card", "PARTS", "SUFFIX"]

WEIGHTS, CARD, SUMS = "weights.safetensors", "card.json", "SHA256SUMS"
PARTS = (CARD, WEIGHTS)
SUFFIX = ".segmodel"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _parts(trained: TrainedModel) -> dict[str, bytes]:
    state = {k: v.detach().cpu().contiguous().clone()
             for k, v in trained.model.state_dict().items()}
    card = {**trained.card, "weights": {"file": WEIGHTS, "tensors": len(state)}}
    files = {CARD: (json.dumps(card, indent=2, allow_nan=False) + "\n").encode(),
             WEIGHTS: save_tensors(state, metadata={"format": CARD_FORMAT})}
    files[SUMS] = "".join(f"{_sha256(files[p])}  {p}\n" for p in PARTS).encode()
    return files


def write_model(trained: TrainedModel, output: str | os.PathLike[str], *,
                overwrite: bool = False) -> Path:
    """Write ``trained`` as a ``.segmodel`` file or a folder (see the module docstring).

    Written under a temporary name beside ``output`` and renamed when complete.

    Raises:
        OutputExistsError: ``output`` exists and ``overwrite`` is off.
    """
    out = Path(output)
    if out.exists() and not overwrite:
        raise OutputExistsError(f"output '{out}' already exists; pass overwrite=true to "
                                "replace it (or choose another path)")
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


def _read_files(path: Path) -> dict[str, bytes]:
    if path.is_dir():
        return {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}
    try:
        with zipfile.ZipFile(path) as zf:
            return {name: zf.read(name) for name in zf.namelist()}
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise InputError(f"model='{path}' is not a model file made by seg-export ({exc}); "
                         "give a .segmodel file or folder, or run=<training run folder>") \
            from None


def _verified(path: Path) -> dict[str, bytes]:
    """The parts of a model file, every checksum checked; a mismatch names the part."""
    if not path.exists():
        raise InputError(f"model='{path}' does not exist; give a file or folder made by "
                         "seg-export")
    files = _read_files(path)
    missing = [p for p in (*PARTS, SUMS) if p not in files]
    if missing:
        raise InputError(f"model='{path}' lacks {missing[0]}: it is not a complete model made "
                         "by seg-export; export it again")
    sums: dict[str, str] = {}
    for line in files[SUMS].decode(errors="replace").splitlines():
        digest, _, name = line.partition("  ")
        sums[name.strip()] = digest.strip()
    for part in PARTS:
        if sums.get(part) != _sha256(files[part]):
            raise InputError(f"model='{path}': {part} does not match its checksum in {SUMS} "
                             "(the file was changed or damaged in transit); get the model "
                             "again from its source")
    return files


def read_card(path: Path) -> dict[str, Any]:
    """A model file's card, its checksums checked (the weights are not loaded)."""
    card, _ = _card_and_files(path)
    return card


def _card_and_files(path: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    files = _verified(path)
    try:
        card: dict[str, Any] = json.loads(files[CARD])
    except ValueError as exc:
        raise InputError(f"model '{path}': {CARD} is not JSON ({exc}); export it "
                         "again") from None
    if not isinstance(card, dict) or card.get("format") != CARD_FORMAT:
        got = card.get("format") if isinstance(card, dict) else None
        raise InputError(f"model '{path}': {CARD} has format {got!r}, not "
                         f"{CARD_FORMAT!r}; export it again with this version")
    return card, files


def read_model(path: str | os.PathLike[str], *, trust: bool = False) -> TrainedModel:
    """A model file's network and card; checksums, card and registry checked first.

    Raises:
        InputError: missing parts, a checksum mismatch (naming the part), an unreadable
            card or weights file, weights that do not fit the card's model.
        ConfigError: a model family the registry does not know (unless ``trust``).
    """
    path = Path(path)
    card, files = _card_and_files(path)
    where = f"model '{path}'"
    node = {k: v for k, v in card["model"].items() if k != "family"}
    model = build_model(node, where=where, trust=trust)
    try:
        state = load_tensors(files[WEIGHTS])
    except (SafetensorError, ValueError) as exc:
        raise InputError(f"{where}: {WEIGHTS} is not readable ({exc}); export it "
                         "again") from None
    load_weights(model, state, where)
    return TrainedModel(model.eval(), card, where)
