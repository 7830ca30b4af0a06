"""The largest tile within a memory budget (tiling.tile_size=auto)."""


from __future__ import annotations

import math
import os
import subprocess
import sys
from types import SimpleNamespace

import psutil
import pytest
import torch
from helpers.data import tiff_module
from helpers.memory import CONF, assert_close, grads, tiny
from hydra import compose, initialize_config_dir

from seg_at_scale.cli.training import check_memory, resolve_auto_tile
from seg_at_scale.errors import ConfigError
from seg_at_scale.memory import (
    GIB,
    MemoryConfig,
    StepSpec,
    apply_memory_mode,
    find_largest_tile,
    measure_step,
)
from seg_at_scale.memory import probe as probe_mod
from seg_at_scale.memory.probe import StepMeasure, probe_server, run_step
from seg_at_scale.models import UNet
from seg_at_scale.tiling import footprint, make_grid
from seg_at_scale.tiling.tile_sides import smallest_side

# ----- the largest tile within a budget ----------------------------------------------------


def test_a_searchs_cpu_probes_fork_from_one_server_that_stops_with_the_search(monkeypatch):
    """Each probe is a process of its own (its peak RSS is the figure), forked from one
    server that imported torch once; the server is gone when the search returns (an idle
    one would hold ~300 MB the training after the search has not budgeted)."""
    parents: list[int] = []
    real = psutil.Process

    def watched(pid: int) -> psutil.Process:
        parents.append(real(pid).ppid())
        return real(pid)

    monkeypatch.setattr(probe_mod, "psutil", SimpleNamespace(Process=watched,
                                                             Error=psutil.Error))
    search = find_largest_tile(tiny(), int(0.7 * GIB), StepSpec(threads=1), max_probes=3,
                               rel_tol=0.5)
    assert len(search.probes) == len(parents) == 3 and search.side > smallest_side(
        footprint(tiny()))
    (server,) = set(parents)
    assert server != os.getpid()
    assert not psutil.pid_exists(server) or real(server).status() == psutil.STATUS_ZOMBIE


@pytest.fixture(scope="class")
def one_probe_server():
    """The class's CPU probes fork from one server (each start imports torch: ~3 CPU-s here);
    every probe is still a fresh fork of it, as in a search of its own."""
    with probe_server():
        yield


@pytest.mark.usefixtures("one_probe_server")
class TestProbesOfOneServer:
    def test_budget_below_the_smallest_tile_is_refused(self):
        with pytest.raises(ConfigError,
                           match=r"memory.budget_gb=0.05 is too small.*smallest legal"):
            find_largest_tile(tiny(), int(0.05 * GIB), StepSpec(threads=1))

    def test_auto_tile_size_fits_the_budget_measured_again(self, tmp_path, scene_files):
        scene_files(tmp_path / "train", shape=(3, 803, 771), classes=4)
        host = psutil.Process().memory_info().rss  # this process "trains": its size is reserved
        budget_gb = round((host + 110 * 2**20) / GIB, 3)
        with initialize_config_dir(CONF, version_base="1.3"):
            cfg = compose("train", overrides=[
                "tiling=grid", "tiling.q=null", "tiling.tile_size=auto", "memory=none",
                f"memory.budget_gb={budget_gb}", "memory.rel_tol=0.5", "memory.max_probes=3",
                "model.in_channels=3", "model.num_classes=4", "task.channels_last=false"])
        net = tiny()
        fp = net.footprint()
        dm = tiff_module(tmp_path, fp, 4, tiling="grid", tile_size=None)
        memory = check_memory(cfg)
        resolve_auto_tile(cfg, net, fp, dm, memory)
        side = cfg.tiling.tile_size
        assert isinstance(side, int) and dm.tiling.tile_size == side
        assert (side - 2 * fp.context) % 4 == 0
        again = measure_step(net, side, StepSpec(memory, threads=1))
        assert again.fits and again.peak_bytes + host - again.base_bytes <= budget_gb * GIB, again
        # larger tiles cut the halo overhead: E at the chosen tile beats the smallest legal tile's
        e_auto = make_grid(803, 771, fp, tile_size=side).efficiency
        assert e_auto < make_grid(803, 771, fp, tile_size=2 * fp.context + 4 * 8).efficiency
        assert math.isfinite(again.seconds)


def test_search_bisects_when_the_fitted_line_overshoots():
    """Fitting probes whose peaks grow far slower than the failing ones (small tiles whose
    peak is floored, noise between close sides): after an overshoot the search must halve
    the bracket, not creep down 15 % per probe from the failed side."""
    net = tiny("same")

    def measure(side: int) -> StepMeasure:
        if side > 1500:  # stopped over budget: no time, the sampled peak
            return StepMeasure(side, 5 * GIB, 0, float("nan"), False, "over budget")
        return StepMeasure(side, int(GIB + 10 * side**2), GIB, 1.0, True)

    s = find_largest_tile(net, 4 * GIB, measure=measure, max_probes=10, rel_tol=0.05)
    assert 0.85 * 1500 <= s.side <= 1500, [(p.side, p.fits) for p in s.probes]


def test_the_training_processs_own_memory_is_counted_and_said():
    """Before: the search took the process's own memory off the budget, and its line said a
    peak of less than the budget it then seemed to leave unused."""
    net = tiny("same")

    def measure(side: int) -> StepMeasure:
        peak = int(GIB + 10 * side**2)
        return StepMeasure(side, peak, GIB, 1.0, peak <= 3 * GIB)

    s = find_largest_tile(net, 4 * GIB, measure=measure, max_probes=10, rel_tol=0.05,
                          host_rss=2 * GIB)
    assert s.reserve_bytes == GIB
    assert s.peak_bytes + s.reserve_bytes <= 0.98 * 4 * GIB
    assert " GiB + 1.00 GiB held by the training process itself of 4.00 GiB (" in s.summary()


def test_warmup_step_runs_on_a_tile_smaller_than_the_measured_one(monkeypatch):
    """On a CPU the figure is the process's high-water mark: a warm-up on the smallest *legal*
    tile (a wide-context network's is as large as the first probes) would hide the step."""
    net = UNet(in_channels=3, num_classes=4, levels=4, base_width=4, padding="same")
    fp = footprint(net)
    sides: list[int] = []
    real = probe_mod._one_step

    def record(net_, opt, side, *args):
        sides.append(side)
        return real(net_, opt, side, *args)

    monkeypatch.setattr(probe_mod, "_one_step", record)
    first = smallest_side(fp)
    run_step(net, first, StepSpec(threads=1))
    assert sides == [4 * fp.align, first] and 4 * fp.align < first
    valid = UNet(in_channels=3, num_classes=4, levels=3, base_width=4, padding="valid")
    sides.clear()
    run_step(valid, smallest_side(footprint(valid)), StepSpec(threads=1))
    assert sides[0] == smallest_side(footprint(valid))  # valid padding: no smaller input


def test_auto_tile_size_needs_a_budget_and_no_q(tmp_path, scene_files):
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=["tiling=grid", "tiling.tile_size=auto"])
        no_budget = compose("train", overrides=["tiling=grid", "tiling.q=null",
                                                "tiling.tile_size=auto"])
    net = tiny()
    dm = tiff_module(tmp_path, net.footprint(), 4, tiling="random")
    with pytest.raises(ConfigError, match=r"tiling.tile_size=auto with tiling.q=2"):
        resolve_auto_tile(cfg, net, net.footprint(), dm, MemoryConfig())
    scene_files(tmp_path / "train", shape=(3, 203, 171), classes=4)
    with pytest.raises(ConfigError, match=r"needs a memory budget: set memory.budget_gb"):
        resolve_auto_tile(no_budget, net, net.footprint(), dm, MemoryConfig())


def test_recomputation_does_not_update_batchnorm_statistics_twice():
    torch.manual_seed(0)
    net = UNet(in_channels=3, num_classes=4, levels=3, base_width=4, norm="batch",
               padding="same").train()
    ref = UNet(in_channels=3, num_classes=4, levels=3, base_width=4, norm="batch",
               padding="same").train()
    ref.load_state_dict(net.state_dict())
    x = torch.randn(2, 3, 40, 52)
    ref(x).square().mean().backward()
    wrapped = apply_memory_mode(net, MemoryConfig("checkpoint", "layers", every=3))
    wrapped(x).square().mean().backward()
    for (k, a), b in zip(ref.state_dict().items(), net.state_dict().values(), strict=True):
        assert torch.allclose(a.float(), b.float(), atol=1e-6), k
    assert_close(grads(net), grads(ref))


def test_probe_child_cannot_allocate_past_its_cap():
    """A probe's child gets RLIMIT_DATA = budget + slack: one huge allocation fails inside
    it (an error the search counts as 'does not fit') instead of taking the machine down."""
    code = ("import torch\n"
            "from seg_at_scale.memory.probe import _cap_memory\n"
            "torch.empty(256 << 20, dtype=torch.uint8).fill_(1)  # 256 MiB: below the cap\n"
            "_cap_memory(2 << 30)\n"
            "torch.empty(256 << 20, dtype=torch.uint8).fill_(1)\n"
            "try:\n"
            "    torch.empty(3 << 30, dtype=torch.uint8).fill_(1)\n"
            "except RuntimeError as e:\n"
            "    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused:" in out.stdout and "allocate" in out.stdout
