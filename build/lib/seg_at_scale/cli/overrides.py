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

__all__ = ["precheck", "flat_keys"]

CONFIG_DIR = Path(__file__).resolve().parents[1] / "conf_predict"


def flat_keys(config_name: str) -> list[str]:
    """The keys of a flat command's config (``predict``, ``export``)."""
    doc = OmegaConf.load(CONFIG_DIR / f"{config_name}.yaml")
    return [str(k) for k in doc if k not in ("defaults", "hydra")]


def _fail(prog: str, message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(USER_ERROR_EXIT)


def _quote_hint(arg: str) -> str:
    key, _, value = arg.partition("=")
    return (f"a value with spaces, commas, brackets or '=' must be quoted for Hydra as well as "
            f"for the shell, e.g. \"{key}='{value}'\"")


def precheck(prog: str, config_name: str | None, argv: Sequence[str] | None = None) -> None:
    """Refuse unreadable overrides and (for a flat ``config_name``) unknown keys.

    Args:
        prog: the command's name, for messages.
        config_name: the flat config whose keys are the only valid ones, or None to check
            the syntax only (``seg-train``'s nested groups are Hydra's to check).
        argv: the arguments (default ``sys.argv[1:]``).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    argv = list(sys.argv[1:] if argv is None else argv)
    multirun = "-m" in argv or "--multirun" in argv
    args = [a for a in argv if not a.startswith("-")]
    parser = OverridesParser.create()
    keys = flat_keys(config_name) if config_name else None
    for arg in args:
        try:
            (override,) = parser.parse_overrides([arg])
        except OverrideParseException as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unreadable"
            _fail(prog, f"cannot read the argument '{arg}' ({first}); {_quote_hint(arg)}")
            return
        if override.is_sweep_override() and not multirun:
            _fail(prog, f"'{arg}' reads as a list of values (a comma); {_quote_hint(arg)}")
        key = override.key_or_group
        if keys is None or key.startswith("hydra") or override.package:
            continue
        if key not in keys:
            near = nearest(key, keys)
            hint = f" (did you mean {near}=?)" if near else ""
            _fail(prog, f"{key}= is not a {prog} key{hint}; see {prog} --help for the keys")
