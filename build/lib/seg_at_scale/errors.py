"""Errors users see. Each message names the file or config key, the bad value and the fix."""

from __future__ import annotations

__all__ = ["SegAtScaleError", "InputError", "ConfigError", "OutputExistsError"]


class SegAtScaleError(Exception):
    """Base class of the project's user-facing errors."""


class InputError(SegAtScaleError, ValueError):
    """An input file or array is unusable (unreadable, truncated, wrong size, bad values)."""


class ConfigError(SegAtScaleError, ValueError):
    """A configuration value is invalid; the message names the key."""


class OutputExistsError(SegAtScaleError, FileExistsError):
    """An output path exists and overwriting was not asked for."""
