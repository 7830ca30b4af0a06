"""Import first, before torch: this process runs torch as the commands do.

tcmalloc where installed (:mod:`seg_at_scale.cli.malloc`: the script re-executes itself
once with it preloaded) and transparent huge pages for torch's CPU tensors where glibc's
malloc runs (:mod:`seg_at_scale.cli`), so a benchmark that compares a command with work done
in its own process compares like with like.
"""

import os

_USERS_THP = "THP_MEM_ALLOC_ENABLE" in os.environ

import seg_at_scale.cli  # noqa: E402, F401 - huge pages for torch's tensors under glibc
from seg_at_scale.cli.malloc import preload, preloaded_library  # noqa: E402

try:
    _REEXEC = preloaded_library() is not None
except ValueError:  # a bad SEG_AT_SCALE_MALLOC: preload says so and exits
    _REEXEC = True
if _REEXEC and not _USERS_THP:
    # decided above for glibc's malloc; the re-executed process decides for tcmalloc
    os.environ.pop("THP_MEM_ALLOC_ENABLE", None)
preload(command=False)
