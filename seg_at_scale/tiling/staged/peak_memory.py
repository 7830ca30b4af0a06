"""The most tensor memory a forward holds at once, counted operation by operation.

A stage tile's memory is not its input and output maps alone: a ConvNeXt block's MLP
holds a map four times as wide as the block's, and smp's U-Net decoder upsamples to the
next stride before concatenating. :func:`~seg_at_scale.tiling.staged.stages.plan_stages` runs
each stage under :class:`LiveMemory` at two small sizes; the difference is what the stage
holds per pixel, which sizes its tiles to the budget.

Every tensor an operation creates is counted from its creation until the last Python
object viewing its storage is gone. Views and in-place results share their storage and
add nothing; storage the forward did not create (its inputs, the parameters) is not
counted. What an operation allocates and frees inside itself (a convolution's scratch)
is not seen.

>>> with LiveMemory() as mem:
...     a = torch.zeros(1000)           # 4000 bytes
...     b = (a + 1).relu_()             # 4000 more; relu_ is in place
...     c = b.view(10, 100) * 2         # 4000 more; the view adds nothing
...     del a                           # 4000 fewer
>>> mem.peak, mem.live
(12000, 8000)
"""

from __future__ import annotations

import weakref
from typing import Any

import torch  # noqa: F401 (the doctest's)
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveMemory"]


class LiveMemory(TorchDispatchMode):
    """Bytes of the tensors created under the mode and alive (``live``), and the most yet.

    ``peak`` is the most ``live`` has been since the mode was entered.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ to keep torch.compile out of it, which
        # imports torch._dynamo on the first operation (1.3 s); nothing here is compiled
        return False

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._held: dict[int, list[int]] = {}  # storage address -> [objects, bytes]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {_address(t) for t in tree_leaves((args, kwargs or {})) if isinstance(t, Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self._hold(t, given)
        return out

    def _hold(self, t: Tensor, given: set[int]) -> None:
        key = _address(t)
        if key == 0:
            return  # no storage (an empty tensor)
        held = self._held.get(key)
        if held is None:
            if key in given:
                return  # a view or in-place result of storage made elsewhere
            held = self._held[key] = [0, t.untyped_storage().nbytes()]
            self.live += held[1]
            self.peak = max(self.peak, self.live)
        held[0] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        held = self._held[key]
        held[0] -= 1
        if held[0] == 0:
            self.live -= held[1]
            del self._held[key]


def _address(t: Any) -> int:
    return int(t.untyped_storage().data_ptr())

