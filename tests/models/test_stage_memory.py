"""What a stage holds: LiveMemory's count, the plan's per-pixel figure, tiles within budget."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch
from helpers.smp import lively
from torch import nn

import seg_at_scale.tiling.staged.stages as staged
from seg_at_scale.cli.malloc import find_tcmalloc
from seg_at_scale.models.smp import SMPModel
from seg_at_scale.models.smp_stage_split import smp_stages
from seg_at_scale.tiling.staged import Chain, Stage, plan_stages, predict_staged
from seg_at_scale.tiling.staged.peak_memory import LiveMemory


class _Measured(nn.Module):
    """A stage module that records the most its tiles held: windows and created maps."""

    def __init__(self, inner: nn.Module, name: str, peaks: dict[str, int]) -> None:
        super().__init__()
        self.inner, self.name, self.peaks = inner, name, peaks
        self.computes_core = getattr(inner, "computes_core", False)

    def forward(self, xs: list[torch.Tensor], **kw: object) -> torch.Tensor:
        with LiveMemory() as mem:
            y = self.inner(xs, **kw)
        windows = sum(x.numel() * 4 for x in xs if x.numel() and x.stride()[-1] != 0)
        self.peaks[self.name] = max(self.peaks.get(self.name, 0), mem.peak + windows)
        return y  # type: ignore[no-any-return]


def _wide() -> nn.Module:
    """Three channels in, two out, sixteen in between: its in and out are a fifth of it."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True),
                         nn.Conv2d(16, 2, 3, padding=1)).eval()


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_forward_holds_what_it_creates_until_it_is_released(channels_last):
    net, x = _wide(), torch.randn(1, 3, 31, 53)
    if channels_last:
        net, x = net.to(memory_format=torch.channels_last), x.to(
            memory_format=torch.channels_last)
    pixels = 31 * 53
    with torch.no_grad(), LiveMemory() as mem:
        y = net(x)
        held = mem.live
    assert mem.peak == (16 + 2) * pixels * 4  # the wide map lives while the last conv runs
    assert held == 2 * pixels * 4  # then only the output
    del y
    assert mem.live == 0


def test_views_in_place_results_inputs_and_parameters_add_nothing():
    x, w = torch.randn(40, 30), nn.Parameter(torch.randn(30, 20))
    with torch.no_grad(), LiveMemory() as mem:
        x.relu_()
        v = x.t()[3:]
        _ = w.t(), x.view(-1)
        assert mem.peak == 0
        y = x * 2  # 4800 bytes
        z = y.t()[1:]  # a view keeps them alive
        del y
        assert mem.live == 40 * 30 * 4
        del z
    assert (mem.peak, mem.live) == (40 * 30 * 4, 0)
    assert v.shape == (27, 40)


def test_the_plan_measures_what_each_stage_holds_per_pixel():
    """16 + 2 floats per pixel for the wide stage, its input not counted; 8 for a stage of
    a stride-2 convolution to 16 channels then a 1 x 1 one: both 16-channel stride-2 maps
    live while the second runs (16 / 4 + 16 / 4 floats per image pixel)."""
    down = Chain(nn.Conv2d(2, 16, 3, 2, 1), nn.Conv2d(16, 16, 1))
    stages = [Stage("wide", Chain(_wide()), (0,), 1),
              Stage("down", down, (1,), 2)]
    with torch.no_grad():
        plan = plan_stages(stages, 3, align=4)
    assert plan.holds == (18.0, 8.0)


@pytest.mark.parametrize("measured", [True, False])
def test_stage_tiles_stay_within_the_budget(measured):
    """Each tile's input windows plus what its forward holds stays under the budget. Sized
    by input and output maps alone (before), the wide stage's tiles held over three times it:
    the ``measured=False`` case shows it, the check having teeth."""
    budget = 12_000  # floats
    peaks: dict[str, int] = {}
    stages = [Stage("wide", _Measured(Chain(_wide()), "wide", peaks), (0,), 1)]
    x = torch.randn(1, 3, 211, 173)
    with torch.no_grad():
        ref = _wide()(x)
        plan = plan_stages(stages, 3, align=1)
    if not measured:
        plan = staged.StagePlan(plan.strides, plan.channels, plan.footprints, plan.used)
    peaks.clear()
    e: list[float] = []
    y = predict_staged(stages, x, align=1, budget=budget, plan=plan, efficiency=e)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-5)
    assert len(e) == 1 and e[0] > 1.0  # tiled
    if measured:
        assert peaks["wide"] <= budget * 4
    else:
        assert peaks["wide"] > 3 * budget * 4


def test_a_convnext_unet_s_stage_tiles_hold_what_the_plan_says(monkeypatch):
    """The real case: ConvNeXt blocks (a 4x MLP) and smp's U-Net decoder (upsampled maps
    concatenated), channels-last as the predictor runs them, cores computed in place. No
    tile holds more than the plan's figure for its window; the stem's tiles, sized by the
    budget, stay under it (the deeper stages' halos make their tiles wider than it)."""
    torch.manual_seed(0)
    net = lively(SMPModel("Unet", "tu-test_convnext", in_channels=4, num_classes=3,
                          options={"decoder_channels": [16, 16, 8, 8, 8]}))
    net = net.eval().to(memory_format=torch.channels_last)
    budget, peaks, windows = 150_000, {}, {}
    stages = [Stage(st.name, _Measured(st.module, st.name, peaks), st.inputs, st.stride)
              for st in smp_stages(net)]
    x = torch.randn(1, 4, 389, 451).to(memory_format=torch.channels_last)
    e: list[float] = []
    with torch.no_grad():
        plan = plan_stages(stages, 4, net.downsampling_factor)
        peaks.clear()  # the plan's own forwards
        real = staged._run_stage

        def run(maps, st, k, *a, **kw):
            out, grid = real(maps, st, k, *a, **kw)
            windows[st.name] = max((t.read.row_end - t.read.row) * (t.read.col_end - t.read.col)
                                   for t in grid)
            return out, grid

        monkeypatch.setattr(staged, "_run_stage", run)
        predict_staged(stages, x, align=net.downsampling_factor, budget=budget, plan=plan,
                       channels_last=True, efficiency=e)
    assert e[1] > 1.0 and len(peaks) == len(stages)
    for k, st in enumerate(stages):
        inputs = sum(plan.channels[i] / plan.strides[i] ** 2
                     for i, u in zip(st.inputs, plan.used[k], strict=True) if u)
        said = (inputs + plan.holds[k]) * windows[st.name] * 4
        assert peaks[st.name] <= said, (st.name, peaks[st.name], said)
    assert peaks["encoder.stem_0..stages_0"] <= budget * 4


_HEAP_CHILD = r"""
import ctypes, sys, torch
from seg_at_scale.tiling.staged.heap_return import large_tensors_mapped

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks "
                "fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info

def mapped_by(n):  # bytes of mapped blocks that allocating n floats added
    before = libc.mallinfo2().hblkhd
    t = torch.ones(n)
    return libc.mallinfo2().hblkhd - before, t

freed = torch.ones(5 << 20)  # 20 MiB, mapped, then freed: glibc raises its threshold past it
del freed
plain, a = mapped_by(6 << 18)  # 6 MiB: now from the heap
set_ = large_tensors_mapped()
fixed, b = mapped_by(6 << 18)
print(plain, set_, fixed)
"""


@pytest.mark.slow  # make test-slow: a start-up mechanism, in fresh interpreters
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_large_tensors_are_mapped_after_glibc_would_have_raised_its_threshold():
    """After a 20 MiB tile is freed, glibc puts a 6 MiB map on the heap, where freed maps of
    other sizes fragment it; with the threshold fixed the map is mapped (and unmapped when
    freed). A fresh process: the setting lasts for the process."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # glibc's malloc
    out = subprocess.run([sys.executable, "-c", _HEAP_CHILD], capture_output=True, text=True,
                         check=True, timeout=120, env=env).stdout.split()
    plain, was_set, fixed = int(out[0]), out[1], int(out[2])
    assert plain == 0  # the behaviour the fix is for
    assert was_set == "True" and fixed >= 6 << 20


_TCMALLOC_CHILD = r"""
import torch
from seg_at_scale.cli.malloc import allocator
from seg_at_scale.tiling.staged.heap_return import give_back_heap, large_tensors_mapped

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

t = torch.ones(64 << 20)  # 256 MiB, freed: tcmalloc keeps it for the next allocation
del t
kept = rss()
gave = give_back_heap()
print(allocator(), large_tensors_mapped(), gave, kept - rss())
"""


@pytest.mark.slow  # make test-slow: a start-up mechanism, in fresh interpreters
@pytest.mark.skipif(find_tcmalloc() is None,
                    reason="no tcmalloc installed (apt-get install libtcmalloc-minimal4)")
def test_under_tcmalloc_the_stages_freed_memory_is_returned_by_tcmalloc():
    """The commands preload tcmalloc, where glibc's settings do nothing: between stages its
    free pages go back to the system (a freed 256 MiB tile: RSS down by at least 200 MiB)."""
    env = {**os.environ, "LD_PRELOAD": str(find_tcmalloc())}
    out = subprocess.run([sys.executable, "-c", _TCMALLOC_CHILD], capture_output=True,
                         text=True, check=True, timeout=120, env=env).stdout.split()
    assert out[:3] == ["tcmalloc", "False", "True"]
    assert int(out[3]) >= 200 << 20, out


def test_staged_runs_map_large_tensors(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(staged, "large_tensors_mapped", lambda: calls.append(1) or True)
    stages = [Stage("wide", Chain(_wide()), (0,), 1)]
    with torch.no_grad():
        predict_staged(stages, torch.randn(1, 3, 40, 30), align=1)
    assert calls == [1]
