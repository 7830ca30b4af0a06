"""Checkpoints loaded as plain data: opening a model never runs code from the file.

A ``.ckpt`` is a pickle. ``torch.load(weights_only=False)`` executes whatever object the
file holds (a ``__reduce__`` that calls ``os.system`` runs the command). Everything the
project stores in a checkpoint (weights, optimiser and scheduler states, callbacks' and
loops' states, hyper-parameters) is plain data, so every load here is
``weights_only=True``; a checkpoint that needs more is refused in one line naming the file,
the Python global it asks for and the fix (``trust_run=true`` for a sender the user trusts,
or a model exported with ``seg-export``, which holds no pickle at all).

Unreadable files (empty, truncated, not a checkpoint) get one line naming the file too,
instead of torch's ``EOFError`` or miniz's message.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from seg_at_scale.errors import TRUST_HINT, InputError

__all__ = ["load_checkpoint", "model_state", "checkpoint_problem", "UnsafeCheckpointError",
           "MEANING_KEY"]

log = logging.getLogger(__name__)

PICKLED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")  # the global a refused pickle asks for
_WEIGHTS_ERROR = re.compile(r"WeightsUnpickler error:\s*([^\n]+)")  # torch's own reason
# what torch.load raises for a file that is not a readable torch file
UNREADABLE = (RuntimeError, EOFError, OSError, ValueError, KeyError, zipfile.BadZipFile)


class UnsafeCheckpointError(InputError):
    """A checkpoint that holds Python objects: loading it would run code from the file."""


def checkpoint_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be loaded as plain data, or None if it can (reads the file)."""
    try:
        load_checkpoint(path)
    except InputError as exc:
        return str(exc)
    return None


#: a run's checkpoint's record of what its weights mean (``trained.weights_meaning``)
MEANING_KEY = "seg_at_scale_weights_meaning"

#: how a refusal names the other checkpoints: seg-predict's key (seg-train's: ``TRAIN_CHOICE``)
PREDICT_CHOICE = "ckpt=last, ckpt=best or a path"
TRAIN_CHOICE = "ckpt_path=<a .ckpt file>, or ckpt_path=none to train the run from the start"


def load_checkpoint(path: str | os.PathLike[str], *, trust: bool = False,
                    choice: str = PREDICT_CHOICE) -> dict[str, Any]:
    """A Lightning checkpoint as plain data (``weights_only=True`` unless ``trust``).

    Args:
        path: the ``.ckpt`` file.
        trust: unpickle any object (runs code from the file); logged.
        choice: how a refusal names the other checkpoints the command can take.

    Raises:
        InputError: missing, empty, truncated or not a checkpoint; or it holds Python
            objects (named) and ``trust`` is off. Nothing in the file has run.
    """
    path = Path(path)
    if not path.is_file():
        what = "a folder" if path.is_dir() else "missing"
        raise InputError(f"checkpoint '{path}' is {what}; give a .ckpt file ({choice})")
    if path.stat().st_size == 0:
        raise InputError(f"checkpoint '{path}' is empty (0 bytes): it was cut off while being "
                         "written; use another checkpoint or copy it again")
    if trust:
        log.warning("trust_run=true: loading '%s' with weights_only=False (this runs any code "
                    "the file holds)", path)
    try:
        with warnings.catch_warnings():  # a pickle.dump file: torch warns of its protocol
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            ckpt = torch.load(path, map_location="cpu", weights_only=not trust)
    except pickle.UnpicklingError as exc:
        found = PICKLED_GLOBAL.search(str(exc))
        said = _WEIGHTS_ERROR.search(str(exc))
        if found is None and said is not None and _pickled(path):  # not by torch.save
            raise UnsafeCheckpointError(
                f"checkpoint '{path}' is not plain data torch can load without running code "
                f"({said.group(1).strip()}): a pickle not written by torch.save, or a "
                f"damaged file; refused. Use another checkpoint, or {TRUST_HINT}") from None
        if found is None:
            raise _unreadable(path, exc, choice) from None
        raise UnsafeCheckpointError(
            f"checkpoint '{path}' holds a Python object ({found.group(1)}) that "
            f"loading would run; refused. {TRUST_HINT.capitalize()}, or ask for a model "
            "exported with seg-export (weights as safetensors)") from None
    except UNREADABLE as exc:
        raise _unreadable(path, exc, choice) from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise InputError(f"checkpoint '{path}' holds no state_dict: it is not a checkpoint "
                         "of a training run; give a .ckpt written by seg-train")
    return ckpt


def _pickled(path: Path) -> bool:
    """The file starts as a pickle of protocol 2 or above does (its PROTO opcode)."""
    with open(path, "rb") as fh:
        return fh.read(1) == b"\x80"


def _unreadable(path: Path, exc: BaseException, choice: str) -> InputError:
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
    return InputError(f"checkpoint '{path}' cannot be read ({reason or type(exc).__name__}): "
                      f"it is truncated or not a torch checkpoint; use another checkpoint "
                      f"({choice}) or copy it again")


def model_state(ckpt: dict[str, Any], prefix: str = "model.") -> dict[str, Tensor]:
    """The network's weights in a task checkpoint (the keys under ``prefix``, stripped)."""
    return {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
