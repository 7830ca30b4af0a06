"""Capability protocols that answer ``isinstance`` the same way on every Python.

A ``typing.runtime_checkable`` protocol checks its members with ``hasattr`` up to Python
3.11 and with ``inspect.getattr_static`` from 3.12 on. The two disagree exactly where
``__getattr__`` answers: an ``nn.Module`` child named like a member (Gated-SCNN's
``stages`` list passed for the ``Staged`` capability up to 3.11, then failed when called),
and a wrapper that only delegates (a memory-mode wrapper lost its footprint from 3.12 on).

Every protocol of the project derives from :class:`Capability`, which applies the 3.12
rule on every Python: a member counts when the object's class or its own ``__dict__``
defines it, never what ``__getattr__`` would return.

>>> from typing import Protocol, runtime_checkable
>>> from torch import nn
>>> @runtime_checkable
... class HasStages(Capability, Protocol):
...     def stages(self) -> list: ...
>>> class Net(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.stages = nn.ModuleList()   # a child, not the method
>>> isinstance(Net(), HasStages), members(HasStages)
(False, frozenset({'stages'}))
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, _ProtocolMeta

__all__ = ["Capability", "members"]

_MISSING = object()


def members(protocol: type) -> frozenset[str]:
    """The public members a protocol asks for (methods, properties, annotated attributes)."""
    names: set[str] = set()
    for base in protocol.__mro__:
        if base is Capability or not base.__dict__.get("_is_protocol", False) \
                or base is Protocol:
            continue
        names |= {n for n in base.__dict__ if not n.startswith("_")}
        names |= {n for n in base.__dict__.get("__annotations__", {}) if not n.startswith("_")}
    return frozenset(names)


class _StaticCheck(_ProtocolMeta):
    """``isinstance(obj, P)``: every member of ``P`` found by ``inspect.getattr_static``."""

    def __instancecheck__(cls, instance: Any) -> bool:
        if not cls.__dict__.get("_is_protocol", False):  # a class that implements one
            return super().__instancecheck__(instance)
        return all(inspect.getattr_static(instance, m, _MISSING) is not _MISSING
                   for m in members(cls))


class Capability(Protocol, metaclass=_StaticCheck):
    """Base of the project's runtime protocols: the same ``isinstance`` on every Python."""
