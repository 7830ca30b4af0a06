"""Progress of a prediction on rank 0: tiles done / total, Mpix/s, ETA (tqdm)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from tqdm import tqdm

__all__ = ["progress_bar"]


class _Quiet:
    def update(self, n: int) -> None:
        """Nothing to show."""


@contextlib.contextmanager
def progress_bar(total: int, show: bool, pixels_per_tile: float, world: int = 1,
                 desc: str = "predict") -> Iterator[Any]:
    """A bar counting tiles (all ranks, estimated from rank 0's share) with Mpix/s.

    ``show=False`` (``progress=false``, ``CI=true`` or a rank other than 0) yields an
    object whose ``update`` does nothing.
    """
    if not show:
        yield _Quiet()
        return
    bar = tqdm(total=total, unit="tile", file=sys.stderr, dynamic_ncols=True,
               desc=desc, smoothing=0.1)

    class _Bar:
        def update(self, n: int) -> None:
            bar.update(min(n * world, total - bar.n))
            rate = bar.format_dict.get("rate") or 0.0
            bar.set_postfix_str(f"{rate * pixels_per_tile / 1e6:.3g} Mpix/s", refresh=False)

    try:
        yield _Bar()
    finally:
        bar.close()
