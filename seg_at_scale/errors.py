"""Errors users see. Each message names the file or config key, the bad value and the fix."""

from __future__ import annotations

import errno
import re

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
#: numpy's ``tofile`` (tifffile writes large arrays with it) on a disk that fills mid-write:
#: a short write with no errno
_SHORT_WRITE = re.compile(r"^(\d+) requested and (\d+) written$")


def disk_full(exc: BaseException) -> SegAtScaleError | None:
    """A disk-full error behind ``exc`` as one line (the work done so far is kept)."""
    seen: BaseException | None = exc
    while seen is not None:
        short = _SHORT_WRITE.match(str(seen)) if isinstance(seen, OSError) else None
        if isinstance(seen, OSError) and (seen.errno in _FULL or short):
            where = f" writing '{seen.filename}'" if seen.filename else ""
            why = (f"{short[2]} of {short[1]} bytes written" if short and seen.errno is None
                   else seen.strerror)
            return SegAtScaleError(f"no space left{where} ({why}); free space or "
                                   "choose another output folder, then run the same command "
                                   "again: what was finished is kept")
        seen = seen.__cause__ or seen.__context__
    return None
