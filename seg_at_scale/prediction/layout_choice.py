"""``layout=auto``: the faster memory layout for this network on this device, measured once.

Channels-last (NHWC) convolutions are 1.1-2.6x faster than NCHW on most CPUs, slower for
DeepLabV3+'s dilated convolutions, and on a GPU in float32 they can be slower too (0.61x
for a small U-Net on an H200). So ``auto`` times the network in both layouts on one tile
(after a warm-up, alternated, the best of two each) the first time a (network shape,
device, precision) is predicted, and keeps the answer in a small JSON file in the
user's cache (``$SEG_AT_SCALE_CACHE``, else ``$XDG_CACHE_HOME/seg_at_scale``, else
``~/.cache/seg_at_scale``). Later predictions read it: the same command on the same machine
takes the same layout, so a resumed prediction continues in the layout it started with.

The labels are the same in either layout up to float rounding; the layout is part of the
prediction's fingerprint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from torch import nn

from seg_at_scale.prediction.options import PredictOptions, with_precision

__all__ = ["with_layout", "cache_path", "layout_key", "measure_layouts", "network_text",
           "device_name", "read_cache", "write_cache"]

log = logging.getLogger(__name__)

#: the side of the square tile the layouts are timed on (one choice per network, whatever
#: the tile: predictions of one network at any tile size take the same layout)
PROBE_SIDE = 512


def cache_path(name: str = "layouts.json") -> Path:
    """The JSON file in the user's cache that keeps one kind of measurement."""
    root = os.environ.get("SEG_AT_SCALE_CACHE")
    if root:
        return Path(root) / name
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "seg_at_scale" / name


def device_name(device: torch.device) -> str:
    """The device in words (a GPU's name; a CPU's model and torch's threads)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu} x{torch.get_num_threads()} threads"


def layout_key(model: nn.Module, bands: int, side: int, autocast: torch.dtype | None) -> str:
    """What the choice depends on.

    The network's shape (not its weights), the device, precision, tile side and torch.
    """
    text = json.dumps([network_text(model), str(autocast), bands, side])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def network_text(model: nn.Module) -> list[Any]:
    """The network's shape (class, names, shapes and dtypes, not weights), device and torch."""
    device = next(model.parameters()).device
    shape = [type(model).__qualname__] + [f"{n}:{tuple(p.shape)}:{p.dtype}"
                                          for n, p in model.state_dict().items()]
    return [shape, device_name(device), torch.__version__]


def measure_layouts(model: nn.Module, bands: int, side: int,
                    autocast: torch.dtype | None) -> dict[str, float]:
    """Seconds of one forward on a ``side`` tile in each layout.

    The best of two, after a warm-up, alternated; the model is left contiguous.
    """
    device = next(model.parameters()).device
    x = torch.randn(1, bands, side, side, device=device)
    formats = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
    best = dict.fromkeys(formats, float("inf"))
    ctx = torch.autocast(device.type, dtype=autocast, enabled=autocast is not None)
    with torch.inference_mode(), ctx:
        for rep in range(3):
            for name, fmt in formats.items():
                model.to(memory_format=fmt)
                xi = x.contiguous(memory_format=fmt)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                model(xi)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if rep:  # the first round warms both up (kernels made per layout)
                    best[name] = min(best[name], time.perf_counter() - t0)
    model.to(memory_format=torch.contiguous_format)
    return best


def with_layout(options: PredictOptions, model: nn.Module, bands: int,
                decide: Any = None) -> PredictOptions:
    """``options`` as the model's device runs them: precision, then layout.

    The fast path's precision there
    (:func:`~seg_at_scale.prediction.options.with_precision`), then with ``layout=auto``
    the faster layout in that precision (measured once, cached).

    ``decide(fn)`` runs ``fn`` on one process and gives its answer to
    every process (several ranks take one precision and one layout); by default ``fn()``.
    """
    options = with_precision(options, next(model.parameters()).device, decide)
    if options.layout != "auto":
        return options
    side = PROBE_SIDE
    key = layout_key(model, bands, side, options.autocast)

    def choose() -> str:
        path = cache_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(path) + ".lock", timeout=600)
        except OSError:
            lock = None  # a cache that cannot be written: measure every time
        with lock if lock is not None else contextlib.nullcontext():
            known = read_cache(path, _valid)
            if key in known:
                return str(known[key]["layout"])
            seconds = measure_layouts(model, bands, side, options.autocast)
            chosen = min(seconds, key=seconds.__getitem__)
            log.info("layout=auto: %s (%s on a %d px tile), kept in %s", chosen, ", ".join(
                f"{k} {v * 1e3:.1f} ms" for k, v in seconds.items()), side, path)
            if lock is not None:
                known[key] = {"layout": chosen, "seconds": seconds, "side": side,
                              "device": device_name(next(model.parameters()).device)}
                write_cache(path, known)
            return chosen

    layout = decide(choose) if decide is not None else choose()
    return replace(options, layout="channels_last" if layout == "channels_last" else
                   "contiguous")


def _valid(entry: Any) -> bool:
    return isinstance(entry, dict) and entry.get("layout") in ("channels_last", "contiguous")


def read_cache(path: Path, valid: Any) -> dict[str, Any]:
    """A cache file's entries; an unreadable or foreign file counts as empty (rewritten).

    ``valid(entry)`` says whether one entry has the expected form.
    """
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) and all(valid(v) for v in doc.values()) else {}


def write_cache(path: Path, entries: dict[str, Any]) -> None:
    """Replace a cache file whole (a temporary file renamed: never half written)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(entries, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot keep the measurement in %s (%s)", path, exc)
        tmp.unlink(missing_ok=True)
