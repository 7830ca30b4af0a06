"""The name a scene's outputs are written under, made safe whatever it was taken from.

A STAC Item's id is free text: taken as a file name, ``../victim`` wrote ``victim.tif``,
its preview and its Item one folder above ``output_dir`` (with ``overwrite=true`` over a
user's image), and ``/some/where/x`` wrote there. :func:`output_stem` turns any name into
one plain file name, so that ``output_dir / (stem + suffix)`` always lies in
``output_dir``; every path that derives a scene's output stem calls it
(:func:`~seg_at_scale.prediction.archive.find_images`: folders, globs, ``.txt`` lists and
STAC ids alike).

>>> output_stem("S2A_T33UUP_20240601", what="item 'S2A_T33UUP_20240601'")
'S2A_T33UUP_20240601'
>>> output_stem("../victim", what="item '../victim'")
'victim'
>>> output_stem("/data/s2/x", what="item '/data/s2/x'")
'data_s2_x'
"""

from __future__ import annotations

import re

from seg_at_scale.errors import InputError

__all__ = ["output_stem", "MAX_STEM_BYTES"]

#: The longest stem (UTF-8 bytes): its longest companion, a temporary
#: ``.<stem>_probabilities.tif.partial.<pid>-<8 hex>.tmp``, stays under the usual
#: 255-byte limit of a file name.
MAX_STEM_BYTES = 200
_SEPARATORS = re.compile(r"[/\\]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ENDS = re.compile(r"^[\s.]+|\s+$")  # leading dots and spaces, trailing spaces


def output_stem(name: str, *, what: str) -> str:
    """``name`` as one plain file name (see the module docstring).

    Path separators (slash and backslash) split it into parts; empty, ``.`` and ``..`` parts are
    dropped and the others joined with ``_``; control characters become ``_``; leading
    dots (a hidden name, as the archive's own working files have) and spaces at either
    end are removed. A plain name is returned unchanged.

    Args:
        name: an item id or a file's stem.
        what: what the name is, for the refusal (``item '../x' of 'items.json'``).

    Raises:
        InputError: nothing is left, or the result is longer than :data:`MAX_STEM_BYTES`.
    """
    parts = [p for p in _SEPARATORS.split(str(name)) if p not in ("", ".", "..")]
    stem = _CONTROL.sub("_", _ENDS.sub("", "_".join(parts)))
    if not stem:
        raise InputError(f"{what} gives no output name: {name!r} is empty or only path "
                         "separators, dots and spaces once made a plain file name; give it "
                         "a name with letters or digits")
    size = len(stem.encode("utf-8", "surrogateescape"))
    if size > MAX_STEM_BYTES:
        raise InputError(f"{what} gives an output name of {size} bytes ('{stem[:40]}...'); "
                         f"file names derived from it would pass the limit of the file "
                         f"system: give it a name of at most {MAX_STEM_BYTES} bytes")
    return stem
