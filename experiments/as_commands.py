"""Import first, before torch: this process runs torch as the commands do.

Transparent huge pages for torch's CPU tensors (:mod:`seg_at_scale.cli`) and tcmalloc where
installed (:mod:`seg_at_scale.cli.malloc`: the script re-executes itself once with it
preloaded), so a benchmark that compares a command with work done in its own process
compares like with like.
"""

import seg_at_scale.cli  # noqa: F401 - huge pages for torch's tensors
from seg_at_scale.cli.malloc import preload

preload(command=False)
