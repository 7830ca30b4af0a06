"""The entry points (``seg-train``, ``seg-predict``, ``seg-export``, ``seg-synth``).

Importing this package prepares the process as the commands need it, before any of them
imports torch: tcmalloc preloaded where installed, for a command starting
(:mod:`seg_at_scale.cli.malloc`), transparent huge pages for torch's CPU tensors where
glibc's malloc runs, and the configs' resolvers. Importing :mod:`seg_at_scale` alone changes
nothing.
"""

import os
from pathlib import Path

from seg_at_scale.cli.malloc import allocator, preload

preload()  # a command starting: re-executed with tcmalloc (where installed) before torch

from seg_at_scale.cli.resolvers import register_resolvers  # noqa: E402

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def enable_huge_pages() -> None:
    """Back torch's CPU tensors of >= 2 MiB with transparent huge pages, under glibc's malloc.

    torch reads ``THP_MEM_ALLOC_ENABLE`` once, at its first allocation, so this runs before
    the commands import torch (child processes - tile-size probes, data workers, DDP ranks -
    inherit it). glibc maps every large block afresh and unmaps it when freed, so without
    huge pages each large tensor is page-faulted in 4 KiB at a time every time it is
    allocated. Measured on the 2-core CPU machine under glibc: a small U-Net step on a
    2432^2 tile 1.47 s/Mpix instead of 2.19-3.03 at the same peak, tile prediction 16-31 %
    faster, ``make demo`` 7 % faster but with a 21 % higher peak RSS.

    Under tcmalloc (the commands' default where installed) freed memory is kept for the next
    tensors and faulted in once, and that once costs more in whole 2 MiB pages than it
    saves: ``seg-predict`` of the 8192^2 demo scene took 12.2-12.4 s with huge pages and
    11.3-11.4 s without (alternated, the kernel's time 3.0 s against 1.1 s, the same peak),
    ``seg-train`` (2 epochs) the same time either way. So nothing is set there.

    Set ``THP_MEM_ALLOC_ENABLE`` yourself (``1`` or ``0``) to decide; nothing is set where
    the kernel offers no huge pages.
    """
    try:
        offered = "[never]" not in _THP.read_text()
    except OSError:
        offered = False
    if offered and allocator() == "system":
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


enable_huge_pages()
register_resolvers()
