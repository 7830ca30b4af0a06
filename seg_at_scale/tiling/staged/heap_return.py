"""Memory the C heap keeps after tiles are freed, given back to the system.

Staged prediction allocates tiles of many shapes, stage after stage. glibc keeps freed
heap memory for later allocations, and it moves its ``mmap`` threshold up to the largest
block freed (up to 32 MB): after the first tile is freed, every map under that size comes
from the heap, where tiles of other sizes fragment it and the process holds what earlier
tiles held. Two remedies, both no-ops where the C library is not glibc (macOS, musl):

* :func:`large_tensors_mapped` fixes the threshold at 4 MiB, so every tile's maps are
  mapped and returned when freed (Unet-ConvNeXt-T at 4096^2, 512 MB stage tiles: each
  stage's peak 250-300 MB lower, no slower within this machine's noise);
* :func:`give_back_heap` trims the heap between stages (``malloc_trim``).

Where tcmalloc is the process's malloc (the commands preload it,
:mod:`seg_at_scale.cli.malloc`), glibc's settings do nothing: tcmalloc keeps freed blocks in
its own page heap, and :func:`give_back_heap` returns them to the system
(``MallocExtension_ReleaseFreeMemory``) instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from typing import Any

__all__ = ["give_back_heap", "large_tensors_mapped", "MAPPED_FROM"]

MAPPED_FROM = 4 << 20  # bytes: blocks this large are mapped (and unmapped when freed)
_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, when it is glibc (the only one with both calls)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


@functools.cache
def _tcmalloc_release() -> Callable[[], Any] | None:
    """Tcmalloc's ``ReleaseFreeMemory``, where tcmalloc is this process's malloc."""
    try:
        return getattr(ctypes.CDLL(None), "MallocExtension_ReleaseFreeMemory", None)
    except OSError:
        return None


def give_back_heap() -> bool:
    """Return the freed heap to the system between stages (glibc's ``malloc_trim``).

    A stage's tiles are freed when it ends, but glibc keeps freed heap memory for later
    allocations; the next stage's tiles have other shapes, so the process grew by what
    earlier stages had held (Unet-ConvNeXt-T at 4096^2, 128 MB stage tiles: peak 2.24 GB,
    1.89 GB with this after each stage, no slower). Under tcmalloc, its free pages are
    returned instead. Returns whether it ran.
    """
    release = _tcmalloc_release()
    if release is not None:
        release()
        return True
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def large_tensors_mapped(threshold: int = MAPPED_FROM) -> bool:
    """Blocks of ``threshold`` bytes or more mapped, and unmapped when freed (``mallopt``).

    Fixing the threshold also stops glibc from raising it as blocks are freed. For the
    whole process, as the environment's ``MALLOC_MMAP_THRESHOLD_`` would. Returns whether
    it was set (not under tcmalloc, whose large blocks :func:`give_back_heap` returns).
    """
    if _tcmalloc_release() is not None:
        return False
    libc = _libc()
    return libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, threshold) == 1
