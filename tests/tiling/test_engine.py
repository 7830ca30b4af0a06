"""The tile engine: :func:`forward_shapes` counts the forwards :func:`run_batches` makes."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch

from seg_at_scale.models import UNet
from seg_at_scale.tiling import footprint, make_grid
from seg_at_scale.tiling.engine import (
    Part,
    PartError,
    TensorWindows,
    count_batches,
    forward_shapes,
    plan_batches,
    run_batches,
    run_parts,
)
from seg_at_scale.tiling.geometry import Footprint


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


@pytest.mark.parametrize("batch_size", [1, 2, 3, 5, 64])
def test_batches_never_mix_sizes_and_their_count_is_the_plans(batch_size):
    """Each batch holds one input size, at most ``batch_size`` tiles, every tile once in
    grid order; counted from ``(size, count)`` pieces (split anywhere) as planned."""
    grid = make_grid(229, 301, Footprint(halo=5, align=4), tile_size=48, uniform=True)
    batches = plan_batches(grid.tiles, batch_size)
    assert [t for b in batches for t in b.tiles] == list(grid.tiles)
    assert [b.index for b in batches] == list(range(len(batches)))
    for b in batches:
        assert 1 <= len(b.tiles) <= batch_size
        assert len({(t.read.height, t.read.width) for t in b.tiles}) == 1
    for a, b in zip(batches, batches[1:]):  # a batch is cut short only where the size changes
        if len(a.tiles) < batch_size:
            assert (a.tiles[0].read.height, a.tiles[0].read.width) != (
                b.tiles[0].read.height, b.tiles[0].read.width)
    pieces = [((t.read.height, t.read.width), 1) for t in grid.tiles]
    assert count_batches(pieces, batch_size) == len(batches)
    halves = [(s, n) for s, one in pieces for n in (0, one)]  # empty pieces change nothing
    assert count_batches(halves, batch_size) == len(batches)
    with pytest.raises(ValueError, match="batch_size=0"):
        count_batches(pieces, 0)


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


def test_parts_run_as_one_stream_each_as_it_runs_alone():
    """An archive's scenes as one stream (``run_parts``): each part's outputs equal its own
    ``run_batches``; the next part's first batch is read before the last part's last
    forward; a read that fails is raised as ``PartError`` naming its part, after every
    output of the parts before it."""
    torch.manual_seed(0)
    net = UNet(3, 2, levels=2, base_width=2, padding="same").eval()
    fp = footprint(net)
    sizes = [(93, 151), (70, 45), (131, 77)]
    images = [torch.randn(1, 3, h, w) for h, w in sizes]
    grids = [make_grid(h, w, fp, tile_size=64, uniform=True) for h, w in sizes]
    events: list[tuple[str, int]] = []

    class Source(TensorWindows):
        def __init__(self, image: torch.Tensor, k: int) -> None:
            super().__init__(image, fp)
            self.k = k

        def load(self, window):
            events.append(("read", self.k))
            if self.k == fail_in:
                raise OSError(f"scene {self.k} went away")
            return super().load(window)

    def model(x: torch.Tensor) -> torch.Tensor:
        events.append(("forward", -1))
        return net(x)

    def parts() -> list[Part]:
        return [Part(Source(x, k), plan_batches(g.tiles, 2), g.height, g.width, fp)
                for k, (x, g) in enumerate(zip(images, grids, strict=True))]

    fail_in = -1
    outs = list(run_parts(model, parts(), device=torch.device("cpu")))
    for k, (x, g) in enumerate(zip(images, grids, strict=True)):
        alone = list(run_batches(net, TensorWindows(x, fp), plan_batches(g.tiles, 2),
                                 height=g.height, width=g.width, fp=fp,
                                 device=torch.device("cpu")))
        mine = [o for o in outs if o.part == k]
        assert [o.batch for o in mine] == [o.batch for o in alone] and len(mine) > 1
        for a, b in zip(mine, alone, strict=True):
            assert all(torch.equal(p, q) for p, q in zip(a.outputs, b.outputs, strict=True))
    first_read_of_1 = events.index(("read", 1))
    forwards_before = sum(e[0] == "forward" for e in events[:first_read_of_1])
    assert forwards_before == len([o for o in outs if o.part == 0]) - 1
    events.clear()
    fail_in = 1
    seen = []
    with pytest.raises(PartError, match="scene 1 went away") as failed:
        for o in run_parts(model, parts(), device=torch.device("cpu")):
            seen.append(o.part)
    assert failed.value.part == 1 and isinstance(failed.value.cause, OSError)
    assert seen == [o.part for o in outs if o.part == 0]
