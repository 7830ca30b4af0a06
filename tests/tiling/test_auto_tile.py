"""``tile_size=auto``: the measured memory of a window predicts a larger one's, the side
chosen fits the budget and the next one does not, a scene that fits runs as one tile
(untiled), and what is tiled still equals the untiled forward."""

from __future__ import annotations

import pytest
import torch

from seg_at_scale.errors import ConfigError
from seg_at_scale.models import UNet
from seg_at_scale.prediction.options import PredictOptions
from seg_at_scale.prediction.plan import with_tile
from seg_at_scale.tiling import auto_tile as auto
from seg_at_scale.tiling import footprint, infer, make_grid, predict_full
from seg_at_scale.tiling.engine import plan_batches
from seg_at_scale.tiling.staged.peak_memory import LiveMemory
from seg_at_scale.tiling.tile_sides import covering_side, legal_side

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def unet(padding: str = "same") -> UNet:
    torch.manual_seed(0)
    return UNet(in_channels=4, num_classes=3, levels=3, base_width=4, padding=padding).eval()


def measured(net: UNet, side: int) -> int:
    with torch.inference_mode(), LiveMemory() as mem:
        net(torch.zeros(1, 4, side, side))
    return mem.peak


@pytest.mark.parametrize("padding", ["same", "valid"])
def test_two_small_windows_predict_a_large_one(padding):
    net = unet(padding)
    fp = footprint(net)
    mem = auto.tile_memory(net, 4, fp)
    side = legal_side(fp, 611)
    assert mem.per_pixel > 0
    assert abs(mem.bytes(side) - measured(net, side)) <= 0.02 * measured(net, side)


def test_the_side_fits_the_budget_and_the_next_step_does_not():
    net = unet()
    fp = footprint(net)
    mem = auto.tile_memory(net, 4, fp)
    budget = int(mem.bytes(700))
    side = auto.fit_side(fp, 5003, 4099, mem, budget)
    assert side == legal_side(fp, side) and mem.bytes(side) <= budget
    assert mem.bytes(side + fp.align) > budget
    # a scene whose covering window fits is one tile: the untiled forward
    cover = covering_side(fp, 301, 257)
    assert auto.fit_side(fp, 301, 257, mem, budget) == cover
    assert len(make_grid(301, 257, fp, tile_size=cover, uniform=True)) == 1
    big = auto.fit_side(fp, 50_000, 50_000, mem, int(mem.bytes(3000)))
    assert big % auto.STEP == 0 or big == legal_side(fp, big // auto.STEP * auto.STEP)


def test_a_budget_below_the_smallest_tile_is_refused_naming_the_fixes():
    net = unet()
    fp = footprint(net)
    mem = auto.tile_memory(net, 4, fp)
    with pytest.raises(ConfigError, match=r"tile_size=auto: the smallest tile .* MiB but "
                                          r"the device allows 0 MiB; give tile_size=.*staged"):
        auto.fit_side(fp, 4000, 4000, mem, budget=1000)


def test_cpu_memory_is_the_hosts_share_split_between_its_processes():
    total = auto.device_memory("cpu")
    assert 0 < total <= (1 << 50)
    assert auto.memory_budget("cpu", 2) == int(total * auto.CPU_SHARE / 2)


@pytest.mark.parametrize("padding", ["same", "valid"])
def test_infer_auto_is_untiled_when_it_fits_and_exact_when_it_tiles(padding, monkeypatch):
    net = unet(padding)
    x = torch.randn(1, 4, 203, 149)
    ref = predict_full(net, x)
    assert torch.equal(infer(net, x, tile_size="auto"), ref)  # fits: the untiled forward
    mem = auto.tile_memory(net, 4, footprint(net))
    monkeypatch.setattr(auto, "memory_budget", lambda device, processes=1: int(mem.bytes(120)))
    assert (infer(net, x, tile_size="auto") - ref).abs().max() < 1e-5


def test_auto_measures_once_per_network_and_never_for_an_image_smaller_than_a_probe(
        monkeypatch):
    """``infer(tile_size="auto")`` and the file path share one measurement per network,
    device, precision, layout and bands; an image whose one tile is no larger than the
    smallest probe runs untiled with no probe at all (the probes of a ResNet encoder took
    9-35 s on this CPU for a 256^2 image that runs in 0.1 s)."""
    net = unet()
    fp = footprint(net)
    probes: list[int] = []
    peak = auto._peak
    monkeypatch.setattr(auto, "_peak", lambda *a: probes.append(a[2]) or peak(*a))
    small = torch.randn(1, 4, 31, 23)  # its one tile is below the smallest probe side
    assert covering_side(fp, 31, 23) <= auto.probe_sides(fp)[0]
    assert torch.equal(infer(net, small, tile_size="auto"), predict_full(net, small))
    assert probes == []
    x = torch.randn(1, 4, 203, 149)
    ref = predict_full(net, x)
    for _ in range(2):
        assert torch.equal(infer(net, x, tile_size="auto"), ref)
    assert probes == auto.probe_sides(fp)  # three forwards, the first call only
    nchw = PredictOptions(layout="contiguous")
    with_tile(nchw, net, fp, 4, 517, 743)  # the file path: the same measurement
    assert probes == auto.probe_sides(fp)
    with_tile(PredictOptions(layout="channels_last"), net, fp, 4, 517, 743)  # measured again
    assert probes == 2 * auto.probe_sides(fp)


def test_prediction_options_take_auto_and_give_each_process_a_batch(monkeypatch):
    net = unet()
    fp = footprint(net)
    opts = PredictOptions()
    assert opts.tile_size == "auto"
    one = with_tile(opts, net, fp, 4, 517, 743)
    assert one.tile_size == covering_side(fp, 517, 743) and one.batch_size == 1
    two = with_tile(opts, net, fp, 4, 517, 743, processes=2)
    grid = make_grid(517, 743, fp, tile_size=two.tile_size, uniform=True)
    assert len(plan_batches(grid.tiles, 1)) >= 2
    assert with_tile(PredictOptions(q=3), net, fp, 4, 517, 743).tile_size == "auto"  # q wins
    assert with_tile(PredictOptions(tile_size=96), net, fp, 4, 517, 743).tile_size == 96


@pytest.mark.parametrize("halo", [8, 46, 94, 837])
def test_a_cpu_tile_stops_growing_once_its_halo_costs_a_tenth(halo):
    from seg_at_scale.tiling import Footprint
    from seg_at_scale.tiling.tile_sides import core_side

    fp = Footprint(halo=halo, align=8)
    side = auto.enough_side(fp)
    assert side >= auto.CPU_FLOOR and side == legal_side(fp, side)
    assert (side / core_side(fp, side)) ** 2 <= auto.CPU_OVERHEAD
    smaller = side - fp.align
    assert smaller < auto.CPU_FLOOR or (smaller / core_side(fp, smaller)) ** 2 > auto.CPU_OVERHEAD
    mem = auto.TileMemory(0.0, 0.0, 100.0)
    assert auto.fit_side(fp, 60_000, 60_000, mem, 1 << 40, cap=side) <= side  # CPU: capped
    assert auto.fit_side(fp, 60_000, 60_000, mem, 1 << 40) > side  # no cap: the memory's
