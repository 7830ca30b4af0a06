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
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from seg_at_scale.cli.common import USER_ERROR_EXIT
from seg_at_scale.config_check import nearest

__all__ = ["precheck", "flat_keys", "train_top_keys", "compose_train", "TRAIN_CONFIG_DIR"]

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

CONFIG_DIR = Path(__file__).resolve().parents[1] / "conf_predict"
TRAIN_CONFIG_DIR = Path(__file__).resolve().parents[1] / "conf"


def flat_keys(config_name: str) -> list[str]:
    """The keys of a flat command's config (``predict``, ``export``)."""
    doc = OmegaConf.load(CONFIG_DIR / f"{config_name}.yaml")
    return [str(k) for k in doc if k not in ("defaults", "hydra")]


def train_top_keys() -> list[str]:
    """What a ``seg-train`` override may start with: its top-level keys and its groups.

    ``conf/train.yaml``'s keys, every config group (a folder of ``conf/``), and the keys the
    shipped experiments and searches add at the top (``optimized_metric``).
    """
    conf = TRAIN_CONFIG_DIR
    keys = {str(k) for k in OmegaConf.load(conf / "train.yaml")} | {
        p.name for p in conf.iterdir() if p.is_dir() and not p.name.startswith("_")}
    for group in ("experiment", "hparams_search"):
        for path in sorted((conf / group).glob("*.yaml")):
            keys |= {str(k) for k in OmegaConf.load(path)}
    return sorted(keys - {"defaults"})


#: How each command takes its arguments, for a refusal of something else.
_EXAMPLES = {"seg-predict": "run=<run folder> image=scene.tif output=labels.tif",
             "seg-train": "model=unet_tiny trainer.max_epochs=5",
             "seg-export": "run=<run folder> output=model.segmodel"}


def _key_value(prog: str) -> str:
    example = _EXAMPLES.get(prog, "key=value")
    return f"arguments are key=value, as in '{prog} {example}' (see {prog} --help)"


def _check_flags(prog: str, argv: Sequence[str], names: set[str]) -> None:
    """``--version``: the project's version; ``--image x``: the key=value to write instead.

    Hydra reads ``--run`` as its own flag (run, not multirun) and the value after it as an
    override, and prints its own version for ``--version``.
    """
    if "--version" in argv:
        import hydra

        from seg_at_scale import __version__

        print(f"{prog} (seg_at_scale) {__version__}, Hydra {hydra.__version__}")
        raise SystemExit(0)
    for i, arg in enumerate(argv):
        name, eq, value = arg[2:].partition("=")
        if not arg.startswith("--") or name not in names:
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else "<value>"
        _fail(prog, f"'{arg}' is not a flag of {prog}: give {name}={value} (arguments are "
              f"key=value; see {prog} --help)")


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
    keys = flat_keys(config_name) if config_name else None
    _check_flags(prog, argv, {*(keys or ()), *(top or ())})
    try:  # Hydra's own flags (--cfg job, --config-dir d, -m) told from the overrides
        flags, rest = get_args_parser().parse_known_args(argv)
    except SystemExit:
        return  # flags Hydra cannot read: Hydra says so itself
    multirun = bool(flags.multirun)
    for arg in rest:
        if arg.startswith("-"):
            _fail(prog, f"'{arg}' is not a flag of {prog}; {_key_value(prog)}")
    args = list(flags.overrides)
    parser = OverridesParser.create()
    own = bool(flags.config_dir or flags.config_path) or any(
        a.startswith("hydra.searchpath") for a in args)
    firsts = None if top is None or own else set(top)
    parsed = []
    for arg in args:
        if "=" not in arg and not arg.startswith("~"):
            _fail(prog, f"'{arg}' is not key=value; {_key_value(prog)}")
        try:
            (override,) = parser.parse_overrides([arg])
            parsed.append(override)
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
                near = _nearest_path(key, first, sorted(firsts), args)
                hint = f" (did you mean {near}=?)" if near else ""
                _fail(prog, f"{key}= is not a {prog} key or group{hint}; the top-level keys "
                      f"and groups are {', '.join(sorted(firsts))}")
        if keys is None or key.startswith("hydra") or override.package:
            continue
        if key not in keys:
            near = nearest(key, keys)
            hint = f" (did you mean {near}=?)" if near else ""
            _fail(prog, f"{key}= is not a {prog} key{hint}; see {prog} --help for the keys")
    if firsts is not None:
        unknown = unknown_nested_key(parsed)
        if unknown is not None:
            _fail(prog, unknown)


def _nearest_path(key: str, first: str, firsts: list[str], args: Sequence[str]) -> str | None:
    """The key ``key`` most likely means, if any.

    A key of the composed config it ends (``lr`` or ``optimizer.lr``: ``task.optimizer.lr``),
    else its first part's nearest top-level name where the rest exists below it (or for a
    key of one part).
    """
    if "." in key or "/" not in key:
        groups = {p.name for p in TRAIN_CONFIG_DIR.iterdir() if p.is_dir()}
        cfg = compose_train([a for a in args if a.split("=", 1)[0] in groups])
        if cfg is not None:
            ending = [p for p in _paths(cfg) if p.endswith(f".{key}")]
            if ending:
                return min(ending, key=len)
            near = nearest(first, firsts)
            rest = key[len(first):].lstrip(".").split(".") if "." in key else []
            if near and (not rest or _walk(cfg.get(near), rest)[1] == len(rest)):
                return near + key[len(first):]
            return None
    near = nearest(first, firsts)
    return near + key[len(first):] if near else None


def _paths(node: Any, prefix: str = "") -> list[str]:
    """Every dotted key path of a config (groups' keys below them)."""
    if not isinstance(node, DictConfig):
        return []
    out = []
    for name in (str(k) for k in node.keys()):
        path = prefix + name
        out.append(path)
        child = node._get_node(name)
        if isinstance(child, DictConfig):
            out += _paths(child, f"{path}.")
    return out


def unknown_nested_key(overrides: Sequence[Override]) -> str | None:
    """What to say of a group's unknown option or a ``group.key`` the config lacks, if any.

    Hydra answers ``trainer.max_epoch=2`` with "Could not override ... To append to your
    config use +trainer.max_epoch=2" and a trace, and ``model=unet_tinyy`` with its config
    search path. A key is looked up in the selected
    group's file (and the files it extends) first; only a key not found there costs a
    composition of the config (about 0.2 s), which decides. Not checked in a sweep over a
    group (its options may differ in their keys).
    """
    groups = {p.name for p in TRAIN_CONFIG_DIR.iterdir() if p.is_dir()}
    chosen: dict[str, str] = {}
    plain: list[Override] = []
    for o in overrides:
        key = o.key_or_group
        if o.package or key.startswith("hydra") or o.is_delete():
            continue
        if key == "model_family":  # mounted by each model preset, not chosen on its own
            family = str(o.value())
            presets = sorted(p.stem for p in (TRAIN_CONFIG_DIR / "model").glob(f"{family}_*.yaml"))
            shown = ", ".join(f"model={p}" for p in presets[:4]) or "model=<family>_<size>"
            return (f"{o.input_line}: a model family is chosen by its model preset, "
                    f"model=<family>_<size> ({shown}); its keys are then model.<key>")
        if key in groups:
            options = sorted(p.stem for p in (TRAIN_CONFIG_DIR / key).glob("*.yaml"))
            numbers = [v for v in (getattr(o.value(), "list", None) or [o.value()])
                       if isinstance(v, int | float)]  # Hydra: "... must be a string ..."
            if numbers:
                v = numbers[0]
                text, what = (str(v).lower(), "a boolean") if isinstance(v, bool) else (
                    str(v), "a number")
                quote = (f"quote it ({key}=\"'{text}'\") or give the option's full name; "
                         if text in options else "")
                return (f"{o.input_line} reads {text} as {what}, and a group's option is a "
                        f"name: {quote}the {key} group's options are {', '.join(options)}")
            if o.is_sweep_override():
                return None
            chosen[key] = option = str(o.value())
            if o.value() is not None and option not in options:
                near = nearest(option, options)
                hint = f" (did you mean {key}={near}?)" if near else ""
                return (f"{key}={option} is not an option of the {key} group{hint}; its "
                        f"options are {', '.join(options)} (seg_at_scale/conf/{key}/)")
        elif "." in key and not (o.is_add() or o.is_force_add()):
            plain.append(o)
    missing = [o for o in plain if not _in_group_file(o.key_or_group, chosen, groups)]
    if not missing:
        return None
    cfg = compose_train([o.input_line for o in overrides
                         if o.input_line and o.key_or_group in groups and not o.package])
    if cfg is None:
        return None
    for o in missing:
        path = o.key_or_group.split(".")
        node, depth = _walk(cfg, path)
        if depth == len(path):
            continue
        where = ".".join(path[:depth])
        if depth == 0:  # a top-level name only some group option sets
            return (f"{o.key_or_group}= is not a key of the config these groups compose "
                    f"({path[0]} is not in it); its top-level keys are "
                    f"{', '.join(sorted(str(k) for k in cfg.keys()))}")
        if not isinstance(node, DictConfig):
            return (f"{o.key_or_group}= sets a key below {where}, which is a value, not a "
                    f"group of keys; set {where}= itself")
        names = sorted(str(k) for k in node.keys())
        if not names:  # an open group (model.options: the architecture's own keywords)
            return (f"{o.key_or_group}= is not a key of {where}, which holds none yet: add "
                    f"it with +{o.key_or_group}= (it is then checked where it is used)")
        near = nearest(path[depth], names)
        hint = f" (did you mean {where}.{near}=?)" if near else ""
        return (f"{o.key_or_group}= is not a key of {where}{hint}; its keys are "
                f"{', '.join(names)}. A key it does not have yet is added with "
                f"+{o.key_or_group}=")
    return None


def compose_train(overrides: Sequence[str]) -> DictConfig | None:
    """``seg-train``'s config composed with ``overrides`` (about 0.2 s), before Hydra's app.

    None when Hydra cannot compose it (an unknown option, a bad value): its app says so
    when it runs.
    """
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=str(TRAIN_CONFIG_DIR), version_base="1.3"):
            return compose("train", overrides=list(overrides))
    except Exception:  # noqa: BLE001 - Hydra's to say
        return None


def _in_group_file(key: str, chosen: dict[str, str], groups: set[str]) -> bool:
    """``key`` is set in its group option's file (or one that file extends).

    Or in ``train.yaml`` for a key of no group. False means "compose to know".
    """
    if chosen.get("experiment") or chosen.get("hparams_search"):
        return False  # they set keys of any group
    first, rest = key.split(".", 1)
    if first not in groups:
        return _has(_load(TRAIN_CONFIG_DIR / "train.yaml"), key)
    todo = [(first, chosen.get(first) or _default_option(first))]
    seen: set[tuple[str, str | None]] = set()
    while todo:
        group, option = todo.pop()
        file = TRAIN_CONFIG_DIR / group / f"{option}.yaml"
        if option is None or (group, option) in seen or not file.is_file():
            continue
        seen.add((group, option))
        doc = _load(file)
        if _has(doc, rest):
            return True
        for entry in doc.get("defaults") or []:  # the files it extends, in its group or
            if isinstance(entry, str) and entry != "_self_":  # another's, placed here
                todo.append((group, entry))
            elif isinstance(entry, DictConfig) and len(entry) == 1:
                (name, value), = entry.items()
                if str(name).startswith("/") and str(name).endswith("@_here_"):
                    todo.append((str(name)[1:-len("@_here_")], str(value)))
    return False


def _default_option(group: str) -> str | None:
    for entry in _load(TRAIN_CONFIG_DIR / "train.yaml").get("defaults", []):
        if isinstance(entry, DictConfig) and group in entry:
            value = entry[group]
            return None if value is None else str(value)
    return None


def _load(file: Path) -> DictConfig:
    doc = OmegaConf.load(file)
    assert isinstance(doc, DictConfig), file  # a config file is a mapping
    return doc


def _has(node: Any, key: str) -> bool:
    parts = key.split(".")
    return _walk(node, parts)[1] == len(parts)


def _walk(node: Any, parts: list[str]) -> tuple[Any, int]:
    """The deepest node of ``parts`` below ``node`` and how many parts led there."""
    for depth, part in enumerate(parts):
        if not isinstance(node, DictConfig) or part not in node.keys():
            return node, depth
        node = node._get_node(part)
    return node, len(parts)
