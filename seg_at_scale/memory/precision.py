"""Check a Lightning ``precision`` against the machine before a run starts.

``32`` / ``32-true`` is the exact reference; ``bf16-mixed`` autocasts to bfloat16 (no loss
scaler needed: bfloat16 has float32's exponent range); ``16-mixed`` autocasts to float16,
and Lightning then scales the loss (its ``GradScaler`` works through ``manual_backward``,
``clip_gradients`` and the optimiser step the task already uses). Lightning itself
silently swaps ``16-mixed`` for ``bf16-mixed`` on a CPU; this module refuses instead,
with the fix, so a run never measures a precision it did not ask for.

>>> normalize_precision("bf16")
'bf16-mixed'
>>> normalize_precision(32)
'32-true'
"""

from __future__ import annotations

import logging

import torch

from seg_at_scale.errors import ConfigError

__all__ = ["PRECISIONS", "normalize_precision", "check_precision", "cpu_supports"]

log = logging.getLogger(__name__)

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
_ALIASES = {"32": "32-true", "32-true": "32-true", "bf16": "bf16-mixed",
            "bf16-mixed": "bf16-mixed", "16": "16-mixed", "16-mixed": "16-mixed",
            # Lightning's other names pass through unchanged
            "64": "64-true", "64-true": "64-true", "bf16-true": "bf16-true",
            "16-true": "16-true"}


def normalize_precision(precision: str | int) -> str:
    """Lightning's name for a precision (``32`` -> ``32-true``, ``bf16`` -> ``bf16-mixed``)."""
    key = str(precision)
    if key not in _ALIASES:
        raise ConfigError(f"trainer.precision={precision!r}: use one of {', '.join(PRECISIONS)} "
                          "(config choices precision=32-true, precision=bf16-mixed, "
                          "precision=16-mixed)")
    return _ALIASES[key]


def cpu_supports(dtype: torch.dtype) -> bool:
    """Whether this CPU has native kernels for ``dtype`` (oneDNN's own check)."""
    mkldnn = torch.ops.mkldnn
    if dtype == torch.bfloat16:
        return bool(mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(mkldnn._is_mkldnn_fp16_supported())
    return True


def _on_cpu(accelerator: str | None, cuda: bool) -> bool:
    acc = (accelerator or "auto").lower()
    return acc == "cpu" or (acc == "auto" and not cuda)


def check_precision(precision: str | int, accelerator: str | None = "auto", *,
                    cuda_available: bool | None = None) -> str:
    """Validate ``precision`` for the accelerator and return Lightning's name for it.

    Args:
        precision: ``32``, ``bf16-mixed``, ``16-mixed`` (or the short ``bf16`` / ``16``).
        accelerator: the Trainer's accelerator (``auto``, ``cpu``, ``gpu``, ``cuda`` ...).
        cuda_available: override the CUDA probe (tests).

    Raises:
        ConfigError: ``16-mixed`` on a CPU (Lightning would quietly run bf16 instead).
    """
    name = normalize_precision(precision)
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if not _on_cpu(accelerator, cuda):
        return name
    if name == "16-mixed":
        native = "has" if cpu_supports(torch.float16) else "has no"
        raise ConfigError(
            f"trainer.precision=16-mixed cannot run on this CPU (accelerator={accelerator}): "
            f"PyTorch Lightning does not do float16 AMP on CPUs (it would silently switch to "
            f"bf16-mixed) and this CPU {native} native float16 kernels. Use precision=bf16-mixed"
            f" (native bfloat16 here: {'yes' if cpu_supports(torch.bfloat16) else 'no'}), "
            "precision=32-true, or trainer=gpu on a CUDA machine")
    if name == "bf16-mixed" and not cpu_supports(torch.bfloat16):
        log.warning("precision=bf16-mixed on a CPU without native bfloat16 kernels: it will "
                    "run emulated and slower than precision=32-true")
    return name
