"""Errors users see. Each message names the file or config key, the bad value and the fix."""

from __future__ import annotations

__all__ = ["SegAtScaleError", "InputError", "ConfigError", "OutputExistsError", "TRUST_HINT"]

#: the fix every refusal of a model or checkpoint that could run code ends with
TRUST_HINT = "pass trust_run=true only if you trust whoever made it (it may then run code)"


class SegAtScaleError(Exception):
    """Base class of the project's user-facing errors."""


class InputError(SegAtScaleError, ValueError):
    """An input file or array is unusable (unreadable, truncated, wrong size, bad values)."""


class ConfigError(SegAtScaleError, ValueError):
    """A configuration value is invalid; the message names the key."""


class OutputExistsError(SegAtScaleError, FileExistsError):
    """An output path exists and overwriting was not asked for."""
