"""Command-line overrides read before Hydra, so mistakes get one line, not a trace.

Hydra answers a typo (``imags=x.tif``) with ``Could not override 'imags'`` and a
multi-line trace ending in ``object_type=dict``; an unquoted path with a bracket
(``"image=scans (1)/a.tif"``: one argument, the shell quoting only for itself) with a lexer
error; and a comma makes a path a list of two. :func:`precheck` reads the arguments
first: a flat command's (``seg-predict``, ``seg-export``) unknown key is named with the
nearest valid key, and a value Hydra cannot read gets the quoting it needs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from omegaconf import OmegaConf

from seg_at_scale.cli.common import USER_ERROR_EXIT
from seg_at_scale.config_check import nearest

__all__ = ["precheck", "flat_keys", "train_top_keys"]

CONFIG_DIR = Path(__file__).resolve().parents[1] / "conf_predict"


def flat_keys(config_name: str) -> list[str]:
    """The keys of a flat command's config (``predict``, ``export``)."""
    doc = OmegaConf.load(CONFIG_DIR / f"{config_name}.yaml")
    return [str(k) for k in doc if k not in ("defaults", "hydra")]


def train_top_keys() -> list[str]:
    """What a ``seg-train`` override may start with: its top-level keys and its groups.

    ``conf/train.yaml``'s keys, every config group (a folder of ``conf/``), and the keys the
    shipped experiments and searches add at the top (``optimized_metric``).
    """
    conf = Path(__file__).resolve().parents[1] / "conf"
    keys = {str(k) for k in OmegaConf.load(conf / "train.yaml")} | {
        p.name for p in conf.iterdir() if p.is_dir() and not p.name.startswith("_")}
    for group in ("experiment", "hparams_search"):
        for path in sorted((conf / group).glob("*.yaml")):
            keys |= {str(k) for k in OmegaConf.load(path)}
    return sorted(keys - {"defaults"})


def _fail(prog: str, message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(USER_ERROR_EXIT)


def _quote_hint(arg: str) -> str:
    key, _, value = arg.partition("=")
    return (f"a value with spaces, commas, brackets or '=' must be quoted for Hydra as well as "
            f"for the shell, e.g. \"{key}='{value}'\"")


def precheck(prog: str, config_name: str | None, argv: Sequence[str] | None = None, *,
             top: Sequence[str] | None = None) -> None:
    """Refuse unreadable overrides and (for a flat ``config_name``) unknown keys.

    Args:
        prog: the command's name, for messages.
        config_name: the flat config whose keys are the only valid ones, or None to check
            the syntax only (``seg-train``'s nested groups are Hydra's to check).
        argv: the arguments (default ``sys.argv[1:]``).
        top: with ``config_name`` None, the valid first parts of a key (``seg-train``'s
            top-level keys and groups, :func:`train_top_keys`): ``modl=unet_tiny`` is named
            with ``model=``, where Hydra advises appending ``+modl=unet_tiny``. Not checked
            when the command adds a config folder of the user's (``--config-dir``,
            ``hydra.searchpath``), whose groups and keys are not known here.
    """
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # Hydra's own flags (--cfg job, --config-dir d, -m) told from the overrides
        flags, rest = get_args_parser().parse_known_args(argv)
    except SystemExit:
        return  # flags Hydra cannot read: Hydra says so itself
    multirun = bool(flags.multirun)
    args = [*flags.overrides, *(a for a in rest if not a.startswith("-"))]
    parser = OverridesParser.create()
    keys = flat_keys(config_name) if config_name else None
    own = bool(flags.config_dir or flags.config_path) or any(
        a.startswith("hydra.searchpath") for a in args)
    firsts = None if top is None or own else set(top)
    for arg in args:
        try:
            (override,) = parser.parse_overrides([arg])
        except OverrideParseException as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unreadable"
            _fail(prog, f"cannot read the argument '{arg}' ({first}); {_quote_hint(arg)}")
            return
        # a flat command never sweeps; seg-train's configs may (hparams_search sets
        # hydra.mode=MULTIRUN), so a list of values there is Hydra's to read
        if override.is_sweep_override() and not multirun and config_name is not None:
            _fail(prog, f"'{arg}' reads as a list of values (a comma); {_quote_hint(arg)}")
        key = override.key_or_group
        if firsts is not None and not (override.is_add() or override.is_force_add()
                                       or override.is_delete() or override.package):
            first = key.replace("/", ".").split(".")[0]
            if first not in firsts:
                near = nearest(first, sorted(firsts))
                hint = f" (did you mean {near}{key[len(first):]}=?)" if near else ""
                _fail(prog, f"{key}= is not a {prog} key or group{hint}; the top-level keys "
                      f"and groups are {', '.join(sorted(firsts))}")
        if keys is None or key.startswith("hydra") or override.package:
            continue
        if key not in keys:
            near = nearest(key, keys)
            hint = f" (did you mean {near}=?)" if near else ""
            _fail(prog, f"{key}= is not a {prog} key{hint}; see {prog} --help for the keys")
