"""Where a module's parameters live: probes and placeholders are made there.

>>> import torch
>>> module_device(torch.nn.Conv2d(1, 1, 1)), module_device(torch.nn.ReLU())
(device(type='cpu'), device(type='cpu'))
"""

from __future__ import annotations

import torch
from torch import nn


def module_device(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (or buffer); the CPU for a module with none."""
    for t in module.parameters():
        return t.device
    for b in module.buffers():
        return b.device
    return torch.device("cpu")
