"""The one rule for generated and converted dataset folders: reuse, refuse or rebuild.

Every dataset builder (synthetic scenes, synthetic streets, synthetic cosmic events, the
larcv3 / Cityscapes / TACO converters) records what it was asked for in
``root/manifest.json`` and asks :func:`reuse` before writing anything:

* same parameters (and every recorded file present): reuse, write nothing;
* other parameters: refused naming each differing key (value on disk, value asked) and the
  fix, unless ``overwrite`` (then rebuilt);
* no manifest but scene files present (someone's own data): refused unless ``overwrite``;
* no manifest, but a build of the same parameters was interrupted there (killed: its
  ``.building.json`` record, written by :func:`begin` before the first scene): resumed, not
  refused — the files it wrote are its own.

The manifest is written last (:func:`save`, atomically), so it only ever describes a
complete folder.

>>> import tempfile
>>> tmp = tempfile.TemporaryDirectory()
>>> root = Path(tmp.name)
>>> reuse(root, "demo", {"seed": 1}, overwrite=False)
False
>>> _ = save(root, "demo", {"seed": 1})
>>> reuse(root, "demo", {"seed": 1}, overwrite=False)
True
>>> reuse(root, "demo", {"seed": 2}, overwrite=False)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
seg_at_scale.errors.InputError: demo: ... other parameters (seed: 1 there, 2 asked); ...
>>> tmp.cleanup()
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from seg_at_scale.errors import InputError, OutputExistsError

__all__ = ["reuse", "save", "listed", "begin", "interrupted_build", "clear_partials",
           "MANIFEST", "BUILDING"]

MANIFEST = "manifest.json"
BUILDING = ".building.json"  # a build in progress: its parameters, removed by save()
_SCENES = ("*/*_image.tif", "*/*_mask.tif", "*/images/*.tif", "*/masks/*.tif")  # find_scenes
_FIX = "pass overwrite=true (seg-train: data.synthetic.overwrite=true; seg-synth: --overwrite)"


def _read(root: Path, source: str, overwrite: bool) -> dict[str, Any] | None:
    path = root / MANIFEST
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        if overwrite:
            return None
        raise InputError(f"{source}: cannot read '{path}' ({exc}); {_FIX} to rebuild the "
                         "folder, or choose another data.root") from exc
    return doc if isinstance(doc, dict) else {}


def reuse(root: str | os.PathLike[str], source: str, params: Mapping[str, Any], *,
          overwrite: bool, files: Sequence[Path] | None = None) -> bool:
    """Whether ``root`` already holds the dataset ``params`` describe (see the module).

    Args:
        root: the dataset folder.
        source: the source's name, for messages (``synthetic``, ``streets``, ...).
        params: everything that determines the folder's contents (JSON values).
        overwrite: rebuild instead of refusing.
        files: files the folder must hold to be reused (default: what the manifest lists).

    Raises:
        InputError: another dataset is there and ``overwrite`` is false.
        OutputExistsError: scene files without a manifest and ``overwrite`` is false.
    """
    root = Path(root)
    want = json.loads(json.dumps(dict(params)))  # tuples -> lists, as stored
    doc = _read(root, source, overwrite)
    if doc is None:
        found = [p for pattern in _SCENES for p in root.glob(pattern)]
        if found and _interrupted(root) == want:
            return False  # our own interrupted build: the builder completes it
        if found and not overwrite:
            raise OutputExistsError(
                f"{source}: '{root}' holds scene files ({found[0].name}, ...) but no "
                f"{MANIFEST}; {_FIX} to replace them, or choose another data.root")
        return False
    old = doc.get("parameters", doc)  # older manifests stored the parameters bare
    if old == want:
        listed = files if files is not None else [root / f for f in doc.get("files", [])]
        return all(Path(f).exists() for f in listed)
    if overwrite:
        return False
    diff = sorted(k for k in set(old) | set(want) if old.get(k) != want.get(k))
    shown = ", ".join(f"{k}: {old.get(k)!r} there, {want.get(k)!r} asked" for k in diff[:4])
    raise InputError(f"{source}: '{root}' holds a dataset made with other parameters "
                     f"({shown}); {_FIX} to rebuild it, or choose another data.root")


def _interrupted(root: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((root / BUILDING).read_text())
    except (OSError, ValueError):
        return None
    return doc.get("parameters") if isinstance(doc, dict) else None


def interrupted_build(root: str | os.PathLike[str], params: Mapping[str, Any]) -> bool:
    """Whether ``root`` holds an interrupted build of these parameters (no manifest yet)."""
    root = Path(root)
    want = json.loads(json.dumps(dict(params)))
    return not (root / MANIFEST).exists() and _interrupted(root) == want


def begin(root: str | os.PathLike[str], source: str, params: Mapping[str, Any]) -> None:
    """Record a build in progress, before its first file (:func:`save` removes it)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{BUILDING}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"source": source, "parameters": dict(params)}) + "\n")
    os.replace(tmp, root / BUILDING)


def clear_partials(files: Sequence[Path]) -> int:
    """Remove the temporary files a killed writer left for ``files`` (see ``io.writer``)."""
    gone = 0
    for f in files:
        for junk in Path(f).parent.glob(f".{Path(f).name}.partial.*.tmp"):
            junk.unlink(missing_ok=True)
            gone += 1
    return gone


def listed(root: str | os.PathLike[str]) -> list[Path]:
    """The files the folder's manifest says it made (none without a readable manifest)."""
    root = Path(root)
    files = (_read(root, "", overwrite=True) or {}).get("files", [])
    return [root / f for f in files] if isinstance(files, list) else []


def save(root: str | os.PathLike[str], source: str, params: Mapping[str, Any],
         files: Sequence[Path] = (), **extra: Any) -> Path:
    """Record a complete folder (atomically: temporary file, then rename)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    doc = {"source": source, "parameters": dict(params),
           "files": sorted(str(Path(f).relative_to(root)) for f in files), **extra}
    tmp = root / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, root / MANIFEST)
    (root / BUILDING).unlink(missing_ok=True)
    return root / MANIFEST
