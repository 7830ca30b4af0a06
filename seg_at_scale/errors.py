"""Errors users see. Each message names the file or config key, the bad value and the fix."""

from __future__ import annotations

import errno

__all__ = ["SegAtScaleError", "InputError", "ConfigError", "OutputExistsError", "TRUST_HINT",
           "disk_full"]

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


_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def disk_full(exc: BaseException) -> SegAtScaleError | None:
    """A disk-full error behind ``exc`` as one line (the work done so far is kept)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FULL:
            where = f" writing '{seen.filename}'" if seen.filename else ""
            return SegAtScaleError(f"no space left{where} ({seen.strerror}); free space or "
                                   "choose another output folder, then run the same command "
                                   "again: what was finished is kept")
        seen = seen.__cause__ or seen.__context__
    return None
