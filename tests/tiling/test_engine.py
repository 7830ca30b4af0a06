"""The tile engine: :func:`forward_shapes` counts the forwards :func:`run_batches` makes."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch

from seg_at_scale.models import UNet
from seg_at_scale.tiling import footprint, make_grid
from seg_at_scale.tiling.engine import TensorWindows, forward_shapes, plan_batches, run_batches


@pytest.mark.parametrize(("tta", "batch_size", "shape"), [
    (None, 1, (93, 613)), (None, 3, (229, 301)), ("flips", 2, (133, 170)), ("d4", 2, (133, 197))])
def test_forward_shapes_are_the_forwards_run_batches_makes(tta, batch_size, shape):
    """Odd sizes: border tiles read less, each size its own forward within a batch; d4
    turns a non-square scene, so its rotated views read transposed windows."""
    torch.manual_seed(0)
    net = UNet(3, 2, levels=2, base_width=2, padding="same").eval()
    fp = footprint(net)
    seen: Counter[tuple[int, int, int]] = Counter()

    def model(x: torch.Tensor) -> torch.Tensor:
        seen[(int(x.shape[0]), int(x.shape[2]), int(x.shape[3]))] += 1
        return net(x)

    h, w = shape
    grid = make_grid(h, w, fp, tile_size=64, uniform=True)
    batches = plan_batches(grid.tiles, batch_size)
    image = torch.randn(1, 3, h, w)
    for _ in run_batches(model, TensorWindows(image, fp), batches, height=h, width=w, fp=fp,
                         device=torch.device("cpu"), tta=tta):
        pass
    expected = forward_shapes(batches, height=h, width=w, fp=fp, tta=tta)
    assert seen == expected and len(expected) > 1


def test_on_the_cpu_each_batch_is_read_between_the_forwards_on_the_callers_thread():
    """No reader thread beside the network's own on the CPU: batch k+1 is read after
    batch k's read and before batch k's forward, in the caller's thread; a read that fails
    is raised to the caller, before the batch's forward."""
    torch.manual_seed(0)
    net = UNet(3, 2, levels=2, base_width=2, padding="same").eval()
    fp = footprint(net)
    h, w = 93, 151
    grid = make_grid(h, w, fp, tile_size=64, uniform=True)
    batches = plan_batches(grid.tiles, 1)
    events: list[tuple[str, str]] = []

    class Source(TensorWindows):
        def load(self, window):
            events.append(("read", threading.current_thread().name))
            if sum(e[0] == "read" for e in events) == fail_at:
                raise OSError("the disk went away")
            return super().load(window)

    def model(x: torch.Tensor) -> torch.Tensor:
        events.append(("forward", threading.current_thread().name))
        return net(x)

    fail_at = 0
    outs = list(run_batches(model, Source(torch.randn(1, 3, h, w), fp), batches, height=h,
                            width=w, fp=fp, device=torch.device("cpu")))
    n = len(batches)
    assert len(outs) == n > 2
    main = threading.current_thread().name
    assert events == [("read", main)] + [(kind, main) for _ in range(n - 1)
                                         for kind in ("read", "forward")] + [("forward", main)]
    events.clear()
    fail_at = 3  # the third batch's read: raised after the second batch's forward
    with pytest.raises(OSError, match="the disk went away"):
        list(run_batches(model, Source(torch.randn(1, 3, h, w), fp), batches, height=h,
                         width=w, fp=fp, device=torch.device("cpu")))
    assert [e[0] for e in events] == ["read", "read", "forward", "read", "forward"]
