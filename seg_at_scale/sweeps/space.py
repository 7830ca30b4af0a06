"""A search space written in Hydra's sweep syntax, sampled by optuna one trial at a time.

Each parameter is a config key and a Hydra sweep expression, as on the command line:

* ``choice(tiny, small, medium)``: categorical;
* ``interval(0.0, 1.0)``: float, uniform; ``tag(log, interval(1e-4, 1e-2))``: log-uniform;
* ``range(2, 9)`` / ``range(2, 9, 2)``: integers ``2 .. 8`` (Hydra's stop is exclusive);
* anything else (``model=unet_tiny``): a fixed override passed to every trial.

A parameter may be *conditional*: ``conditions={"memory": {"model": ["unet_medium"]}}``
samples ``memory`` only in trials whose ``model`` is ``unet_medium``; other trials keep the
config's default. TPE models conditional parameters with ``group=True``.

>>> space = search_space({"model": "choice(unet_tiny,unet_small)",
...                       "task.optimizer.lr": "tag(log, interval(1e-4, 1e-2))"},
...                      fixed=["trainer=fast"])
>>> [p.name for p in space.params], space.fixed
(['model', 'task.optimizer.lr'], ('trainer=fast',))
>>> space.overrides({"model": "unet_tiny", "task.optimizer.lr": 0.001})
['trainer=fast', 'model=unet_tiny', 'task.optimizer.lr=0.001']
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep

from seg_at_scale.errors import ConfigError

__all__ = ["Param", "SearchSpace", "search_space", "encode_value"]

Choice = str | int | float | bool


@dataclass(frozen=True)
class Param:
    """One searched config key.

    Attributes:
        name: the override key (``task.optimizer.lr``, ``model``, ``+x``).
        kind: ``categorical``, ``float`` or ``int``.
        choices: the categories (``categorical``).
        low: lowest value (``float``, ``int``).
        high: highest value, included (``float``, ``int``).
        log: sample on a log scale.
        step: integer step (``int``).
        when: ``(other key, allowed values)``: sample only when the other key took one of
            these values, else leave the config's default.
    """

    name: str
    kind: str
    choices: tuple[Choice, ...] = ()
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    step: int = 1
    when: tuple[str, tuple[Choice, ...]] | None = None

    def suggest(self, trial: Any) -> Any:
        """Ask an optuna trial for this parameter's value."""
        if self.kind == "categorical":
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high), step=self.step,
                                     log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, log=self.log)


@dataclass(frozen=True)
class SearchSpace:
    """Searched parameters (in sampling order) and the overrides every trial gets.

    Attributes:
        params: the searched keys; a conditional one comes after the key it depends on.
        fixed: override strings passed unchanged to every trial.
    """

    params: tuple[Param, ...]
    fixed: tuple[str, ...] = ()

    def suggest(self, trial: Any) -> dict[str, Any]:
        """Sample one trial's values (define-by-run: conditions see earlier values)."""
        values: dict[str, Any] = {}
        for p in self.params:
            if p.when is None or values.get(p.when[0]) in p.when[1]:
                values[p.name] = p.suggest(trial)
        return values

    def overrides(self, values: Mapping[str, Any]) -> list[str]:
        """The Hydra overrides of a trial: the fixed ones, then ``key=value`` per value."""
        return [*self.fixed, *(f"{k}={encode_value(v)}" for k, v in values.items())]


_PLAIN = re.compile(r"^[A-Za-z0-9_./:\-]+$")


def encode_value(value: Any) -> str:
    """A value as Hydra's override grammar reads it back (``None`` -> ``null``).

    >>> [encode_value(v) for v in (None, True, 3, 0.25, "tiny", "a b")]
    ['null', 'true', '3', '0.25', 'tiny', "'a b'"]
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    if _PLAIN.match(text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _param(override: Override, where: str) -> Param:
    """The :class:`Param` of one sweep override (``where`` names it in errors)."""
    value = override.value()
    name = override.get_key_element()
    if isinstance(value, ChoiceSweep):
        choices = tuple(c if isinstance(c, (str, int, float, bool)) else str(c)
                        for c in value.list)
        return Param(name, "categorical", choices=choices)
    if isinstance(value, IntervalSweep):
        low, high = float(value.start), float(value.end)  # type: ignore[arg-type]
        log = "log" in value.tags
        if not low < high or (log and low <= 0):
            raise ConfigError(f"{where}: interval needs low < high "
                              "(and low > 0 with tag(log, ...)), e.g. interval(0.0, 1.0)")
        return Param(name, "float", low=low, high=high, log=log)
    if isinstance(value, RangeSweep):
        start, stop, step = value.start, value.stop, value.step
        if not (isinstance(start, int) and isinstance(stop, int) and isinstance(step, int)) \
                or stop <= start:
            raise ConfigError(f"{where}: range() searches integers "
                              "start .. stop - 1, e.g. range(2, 9); use interval() for floats")
        last = start + (stop - 1 - start) // step * step
        return Param(name, "int", low=start, high=last, step=step,
                     log="log" in value.tags)
    raise ConfigError(f"{where}: use choice(...), interval(...), "
                      "tag(log, interval(...)) or range(...)")


def search_space(params: Mapping[str, Any], fixed: Sequence[str] = (),
                 conditions: Mapping[str, Mapping[str, Sequence[Any]]] | None = None,
                 key: str = "hydra.sweeper.params") -> SearchSpace:
    """Parse ``{config key: sweep expression}`` (and command-line overrides) into a space.

    Args:
        params: the searched keys and their Hydra sweep expressions; a value that is not a
            sweep (``tiny``) becomes a fixed override.
        fixed: command-line overrides; sweep expressions among them are searched too (and
            replace a ``params`` entry of the same key), the others are passed to every trial.
        conditions: ``{key: {other key: [values]}}``: sample ``key`` only when ``other key``
            took one of ``values``.
        key: the config key ``params`` came from, for error messages.

    Returns:
        The :class:`SearchSpace`.

    Raises:
        ConfigError: an unparsable expression, an empty interval, or a condition on a key that
            is not searched (or searched after the key it conditions).
    """
    parser = OverridesParser.create()
    lines = [f"{k}={v}" for k, v in params.items()] + list(fixed)
    where = [f"{key}.{line}" for line in lines[:len(params)]]
    where += [f"command-line override {line}" for line in lines[len(params):]]
    found: dict[str, Param] = {}
    kept: dict[str, str] = {}  # key -> override line; a later line replaces an earlier one
    values: dict[str, str] = {}  # key -> fixed value, for conditions on a fixed key
    for line, label, override in zip(lines, where, parser.parse_overrides(lines)):
        name = override.get_key_element()
        if override.is_sweep_override():  # replaces a searched key in its place
            kept.pop(name, None)
            found[name] = _param(override, label)
        else:
            found.pop(name, None)
            kept[name] = line
            values[name] = override.get_value_element_as_str()
    ordered = list(found.values())
    for name, rule in (conditions or {}).items():
        if name in kept:
            continue  # fixed on the command line: no longer searched
        if name not in found or len(rule) != 1:
            raise ConfigError(f"hydra.sweeper.conditions.{name}={dict(rule)!r}: the key must be "
                              "searched and the rule one {other key: [values]} pair")
        (other, allowed), = rule.items()
        allowed = tuple(allowed) if isinstance(allowed, (list, tuple)) else (allowed,)
        here = ordered.index(found[name])
        if other in values:  # the other key is fixed: the condition holds or not, once
            if values[other] in {encode_value(a) for a in allowed}:
                continue
            ordered.pop(here)
        elif other in found and found[other] in ordered[:here]:
            found[name] = Param(**{**found[name].__dict__, "when": (other, allowed)})
            ordered[here] = found[name]
        else:
            raise ConfigError(f"hydra.sweeper.conditions.{name}: '{other}' must be a searched "
                              f"key listed before '{name}' in {key}, or a fixed override")
    return SearchSpace(tuple(ordered), tuple(kept.values()))
