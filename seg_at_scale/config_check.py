"""One validator for every config group: unknown keys, missing keys, value types.

Every group that crosses into the library (``data``, ``tiling``, ``memory``, ``pipeline``,
a ``model`` of the registry, the prediction options) goes through :func:`known_keys`, so
an unknown key is refused the same way everywhere, naming the nearest valid key, and a
missing one naming where to set it. Groups whose values have a type to check use
:func:`check_types` against the constructor's or dataclass's type hints.

>>> known_keys("t", {"q": 2, "tilesize": 512}, ["q", "tile_size"])  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
seg_at_scale.errors.ConfigError: t.tilesize is not a t key (did you mean t.tile_size?): ...
>>> fits([1, 2], list[int]), fits("abc", int | None), fits(True, int)
(True, False, False)

A key that names a file takes a local path (:func:`check_local`): every input is read from a
local (or mounted) file system and every output written to one, since inputs are checked and
hashed before any work and outputs are written under temporary names, renamed when
complete. A URL or a GDAL virtual path would otherwise be taken for a relative or missing
local path, and refused with a message that does not say why.

>>> remote_kind("/vsis3/bucket/a.tif"), remote_kind("s3://bucket/a.tif")
('a GDAL virtual path', 'a URL (s3:)')
>>> [remote_kind(p) for p in ("scenes/a.tif", "scene:1.tif", "file:///data/a.tif", "C:/a.tif")]
[None, None, None, None]
"""

from __future__ import annotations

import collections.abc
import difflib
import re
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, cast

from omegaconf import DictConfig, ListConfig, OmegaConf

from seg_at_scale.errors import ConfigError, SegAtScaleError

__all__ = ["known_keys", "check_types", "fits", "describe", "nearest", "resolved", "HYDRA_KEYS",
           "remote_kind", "check_local", "unset_keys"]

HYDRA_KEYS = frozenset({"_target_", "_convert_", "_recursive_", "_partial_"})
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+)://")


def nearest(key: str, names: Iterable[str]) -> str | None:
    """The valid name closest to a mistyped ``key``, if any is close."""
    close = difflib.get_close_matches(str(key), list(names), n=1, cutoff=0.6)
    return close[0] if close else None


def resolved(node: DictConfig) -> dict[str, Any]:
    """A config group as plain Python, interpolations resolved: a dict keyed by its names.

    (``OmegaConf.to_container`` returns a dict for a ``DictConfig``; its annotation is any
    container.)
    """
    return cast(dict[str, Any], OmegaConf.to_container(node, resolve=True))


def unset_keys(cfg: DictConfig | ListConfig, prefix: str = "") -> list[str]:
    """The dotted keys whose value is still ``???`` (a group leaves them to the user).

    Read without resolving interpolations, so a key that only refers to an unset one
    (``model.in_channels: ${data.bands}``) is not listed: the unset key is.

    >>> unset_keys(OmegaConf.create({"data": {"bands": "???", "n": "${data.bands}"}, "q": 2}))
    ['data.bands']
    """
    found = []
    keys: list[Any] = list(range(len(cfg)) if isinstance(cfg, ListConfig) else cfg.keys())
    for key in keys:
        name = f"{prefix}{key!s}"
        if OmegaConf.is_missing(cfg, key):
            found.append(name)
            continue
        node = cfg._get_node(key)  # the node itself: an interpolation is not followed
        if isinstance(node, DictConfig | ListConfig) and not OmegaConf.is_interpolation(
                cfg, key) and not node._is_none():
            found += unset_keys(node, f"{name}.")
    return found


def known_keys(group: str, values: Mapping[str, Any], names: Iterable[str], *,
               required: Iterable[str] = (), ignore: Iterable[str] = HYDRA_KEYS,
               where: str = "") -> dict[str, Any]:
    """``values`` without ``ignore``d keys; an unknown or missing key refused by name.

    Args:
        group: the group's name as users write it (``tiling``), prefixed to keys.
        values: the group's keys and values.
        names: the valid keys.
        required: keys that must be present.
        ignore: keys dropped silently (Hydra's own).
        where: what the values came from (``run 'r'``), put before the message.
    """
    names = list(names)
    skip = set(ignore)
    values = {k: v for k, v in values.items() if k not in skip}
    pre = f"{where}: " if where else ""
    dot = f"{group}." if group else ""
    for key in values:
        if key not in names:
            near = nearest(key, names)
            hint = f" (did you mean {dot}{near}?)" if near else ""
            raise ConfigError(f"{pre}{dot}{key} is not a{' ' + group if group else ''} key"
                              f"{hint}: use one of {', '.join(sorted(names))}")
    for key in required:
        if key not in values:
            raise ConfigError(f"{pre}the {group} group sets no {dot}{key}: add it to the "
                              f"group's YAML (conf/{group}/) or give {dot}{key}=...")
    return values


def check_types(group: str, values: Mapping[str, Any], hints: Mapping[str, Any], *,
                where: str = "") -> None:
    """Refuse the first value whose type is not its key's hint, naming key and value."""
    pre = f"{where}: " if where else ""
    dot = f"{group}." if group else ""
    for key, value in values.items():
        hint = hints.get(key, Any)
        if not fits(value, hint):
            raise ConfigError(f"{pre}{dot}{key}={value!r} is not {describe(hint)}; "
                              f"give {dot}{key}=<{describe(hint)}>")


def fits(value: Any, hint: Any) -> bool:
    """Whether a plain config value (YAML scalar, list, mapping) has the hinted type."""
    if hint is Any or hint is object:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple, collections.abc.Sequence) or hint in (list, tuple):
        return _fits_sequence(value, origin, args)
    if origin in (dict, collections.abc.Mapping) or hint in (dict, collections.abc.Mapping):
        return isinstance(value, Mapping)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _fits_sequence(value: Any, origin: Any, args: tuple[Any, ...]) -> bool:
    if not isinstance(value, list | tuple):
        return False
    if origin is tuple and len(args) > 1 and args[-1] is not Ellipsis:
        return len(value) == len(args) and all(fits(v, a) for v, a in zip(value, args))
    item = args[0] if args else Any
    return all(fits(v, item) for v in value)


def describe(hint: Any) -> str:
    """A type hint in words (``a whole number or null``)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if hint is type(None):
        return "null"
    if origin is typing.Literal:
        return "one of " + ", ".join(str(a).lower() if isinstance(a, bool) else repr(a)
                                     for a in args)
    if origin is tuple and len(args) > 1 and Ellipsis not in args:  # a fixed length
        inner = " or ".join(dict.fromkeys(describe(a) for a in args))
        return f"a list of {len(args)} ({inner})"
    if origin in (list, tuple, collections.abc.Sequence):
        inner = " or ".join(describe(a) for a in args if a is not Ellipsis) or "values"
        return f"a list of ({inner})"
    if origin in (dict, collections.abc.Mapping):
        return "a mapping"
    words = {int: "a whole number", float: "a number", str: "a string", bool: "true or false"}
    return words.get(hint, getattr(hint, "__name__", str(hint)))


def remote_kind(text: str) -> str | None:
    """What ``text`` is when it names no local file: a URL or a GDAL virtual path; else None.

    A URL is ``<scheme>://``: a file name with a colon (``scene:1.tif``) is a local path,
    ``file://`` URLs name local files, and ``C:/`` is a Windows drive.
    """
    if text.startswith("/vsi"):
        return "a GDAL virtual path"
    url = _URL.match(text)
    if url and url[1].lower() != "file":
        return f"a URL ({url[1]}:)"
    return None


def check_local(what: str, text: str, *, output: bool = False,
                error: type[SegAtScaleError] = ConfigError) -> None:
    """Refuse ``text`` when it is a URL or a GDAL virtual path, saying what to do.

    ``what`` names it in the message (``image='s3://b/a.tif'``); ``output``: the path is
    written (the fix is to write locally, then copy).
    """
    kind = remote_kind(text)
    if kind is None:
        return
    why = ("outputs are written under temporary names and renamed when complete" if output
           else "each input is checked and hashed before any work")
    fix = ("write to a local or mounted folder, then copy the result there (aws s3 cp, "
           "gsutil cp, rclone copy)") if output else (
        "copy it to a local or mounted folder first (aws s3 cp, gsutil cp, rclone copy, "
        "or gdal_translate from a /vsi path) and give that path")
    raise error(f"{what} is {kind}: seg_at_scale reads and writes local files only ({why}); "
                f"{fix}")
