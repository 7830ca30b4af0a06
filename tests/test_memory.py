"""Memory modes, precision checks and the largest-tile search (issue 4).

Each memory mode must give the loss and gradients of ``none`` (fp32, 1e-5), untiled and
through exact tiled training; the search must pick a tile whose step, measured again in a
fresh process, stays within the budget; bad combinations must be refused with the key.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import pytorch_lightning as pl
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from seg_at_scale.cli.train import check_memory, resolve_auto_tile
from seg_at_scale.data.datamodule import TileDataModule
from seg_at_scale.errors import ConfigError
from seg_at_scale.memory import (
    GIB,
    MODES,
    MemoryConfig,
    MemoryReport,
    StepSpec,
    apply_memory_mode,
    check_precision,
    find_largest_tile,
    measure_step,
    memory_config,
    pipe_checkpoint_mode,
)
from seg_at_scale.memory import probe as probe_mod
from seg_at_scale.memory.probe import StepMeasure, run_step
from seg_at_scale.memory.segments import cut_segments
from seg_at_scale.memory.sides import smallest_side
from seg_at_scale.models import UNet, UResNet
from seg_at_scale.models.layers import run_layers
from seg_at_scale.tasks import SegmentationTask
from seg_at_scale.tasks.losses import CrossEntropy
from seg_at_scale.tiling import footprint, make_grid, predict_full, predict_tiled, tiled_backward

CONF = str(Path(__file__).resolve().parents[1] / "seg_at_scale" / "conf")
CONFIGS = [MemoryConfig(m, granularity=g, every=3)
           for m in MODES if m != "none" for g in ("level", "block", "layers")
           if g == "level" or "checkpoint" in m]
CONFIGS.append(MemoryConfig("checkpoint", granularity="strips", strip_rows=6))  # 6 rows: many
# blocks: 10 columns at the first level (6 at the second: never fewer than the rows)
CONFIGS.append(MemoryConfig("checkpoint", granularity="strips", strip_rows=6, strip_cols=10))


def tiny(padding: str = "same", levels: int = 3) -> UNet:
    torch.manual_seed(0)
    return UNet(in_channels=3, num_classes=4, levels=levels, convs_per_level=2, base_width=4,
                padding=padding)


def grads(net: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in net.parameters()]


def assert_close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float = 1e-5) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x - y).abs().max().item() <= tol * max(1.0, y.abs().max().item())


# ----- memory modes: same numbers as `none` ------------------------------------------------


@pytest.mark.parametrize(("cfg", "padding"),
                         [(c, "same") for c in CONFIGS] +
                         [(c, "valid") for c in CONFIGS if c.granularity == "level"],
                         ids=lambda v: v if isinstance(v, str)
                         else f"{v.mode}-{v.granularity}-{v.strip_cols}")
def test_mode_gives_the_loss_and_gradients_of_none_untiled(cfg, padding):
    net = tiny(padding)
    x = torch.randn(2, 3, net.valid_input_size(53), net.valid_input_size(77))
    loss_fn = CrossEntropy(4)
    y = net(x)
    target = torch.randint(0, 4, (2, *y.shape[-2:]))
    s, w = loss_fn(y, target)
    (s / w).backward()
    ref = grads(net)
    net.zero_grad(set_to_none=True)
    wrapped = apply_memory_mode(net, cfg)
    s2, w2 = loss_fn(wrapped(x), target)
    (s2 / w2).backward()
    assert abs((s2 / w2).item() - (s / w).item()) <= 1e-5
    assert_close(grads(net), ref)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.mode}-{c.granularity}-{c.strip_cols}")
def test_mode_gives_the_gradients_of_none_tiled(cfg):
    net = tiny("same")
    image, target = torch.randn(1, 3, 97, 83), torch.randint(0, 4, (1, 97, 83))
    loss_ref = tiled_backward(net, image, target, CrossEntropy(4), q=2)
    ref = grads(net)
    net.zero_grad(set_to_none=True)
    loss = tiled_backward(apply_memory_mode(net, cfg), image, target, CrossEntropy(4), q=2)
    assert abs(loss.item() - loss_ref.item()) <= 1e-5
    assert_close(grads(net), ref)


@pytest.mark.parametrize(("connections", "upsample", "downsample", "cols"),
                         [("concat", "interpolation", "max_pool", None),
                          ("sum", "transpose", "strided_conv", None),
                          ("concat", "interpolation", "max_pool", 10),
                          ("sum", "transpose", "strided_conv", 10)])
def test_strips_give_the_gradients_of_none_on_a_uresnet(connections, upsample, downsample, cols):
    """Residual levels, 5 x 5 stem, three planes folded into the batch, bilinear or
    transposed upsampling, pooling or strided downsampling: strips of 4 rows on 52 x 36,
    whole rows or blocks of 10 columns."""
    torch.manual_seed(0)
    net = UResNet(planes=3, num_classes=3, depth=3, initial_filters=4, blocks_per_layer=1,
                  blocks_deepest=1, bottleneck_deepest=8, connections=connections,
                  upsample=upsample, downsample=downsample, batch_norm=False)
    x = torch.randn(1, 3, 52, 36)
    net(x).square().mean().backward()
    ref = grads(net)
    net.zero_grad(set_to_none=True)
    strips = apply_memory_mode(net, MemoryConfig("checkpoint", "strips", strip_rows=4,
                                                 strip_cols=cols))
    out = strips(x)
    assert torch.allclose(out, net(x), atol=1e-5)
    out.square().mean().backward()
    assert_close(grads(net), ref)


def test_strips_keep_only_level_boundaries():
    """What autograd holds after the forward pass: the input, each level's pooled output and
    its output from below - no full-resolution feature map of the first level's width."""
    net = tiny("same", levels=4)
    x = torch.randn(1, 3, 128, 64)
    held: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def saved(cfg: MemoryConfig) -> int:
        held.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            apply_memory_mode(net, cfg)(x).sum()
        return sum(held.values()) - x.numel() * 4  # less the image

    full_map = 4 * 4 * 128 * 64  # one fp32 map of the first level's 4 channels
    assert saved(MemoryConfig("none")) > 8 * full_map  # what the plain step holds
    for cols in (None, 16):
        kept = saved(MemoryConfig("checkpoint", "strips", strip_rows=16, strip_cols=cols))
        assert kept < 2 * full_map, (cols, kept)


def test_strips_refuse_what_they_cannot_do_exactly():
    bn = UNet(in_channels=3, num_classes=4, levels=3, base_width=4, padding="same",
              norm="batch").train()
    with pytest.raises(ConfigError, match=r"strips with train-mode BatchNorm.*granularity=level"):
        apply_memory_mode(bn, MemoryConfig("checkpoint", "strips"))(torch.randn(1, 3, 32, 32))
    with pytest.raises(ConfigError, match=r"strips needs padding='same', not 'valid'"):
        apply_memory_mode(tiny("valid"), MemoryConfig("checkpoint", "strips"))
    with pytest.raises(ConfigError, match=r"memory.strip_rows=7: use an even number"):
        MemoryConfig("checkpoint", "strips", strip_rows=7)
    with pytest.raises(ConfigError, match=r"memory.strip_cols=9: use an even number.*or null"):
        MemoryConfig("checkpoint", "strips", strip_cols=9)
    with pytest.raises(ConfigError, match=r"strips .*does not combine with offload"):
        MemoryConfig("checkpoint_offload", "strips")
    with pytest.raises(ConfigError, match=r"strips does not run inside a Pipe.*granularity=level"):
        pipe_checkpoint_mode(MemoryConfig("checkpoint", "strips"))


def test_wrapped_model_shares_parameters_state_dict_and_footprint():
    net = tiny("valid")
    ck = apply_memory_mode(net, "checkpoint")
    assert list(ck.state_dict()) == list(net.state_dict())
    assert all(a is b for a, b in zip(ck.parameters(), net.parameters(), strict=True))
    assert footprint(ck) == net.footprint() and ck.downsampling_factor == 4
    ck.load_state_dict({k: torch.zeros_like(v) for k, v in net.state_dict().items()})
    assert all(float(p.abs().sum()) == 0.0 for p in net.parameters())
    ck.eval()
    assert not net.training and apply_memory_mode(ck, "none") is net


def test_segments_carry_skips_and_cover_every_layer():
    net = tiny("same", levels=4)
    layers = net.pipeline_layers()
    level = cut_segments(layers, "level")
    assert len(level) == 2 * net.levels - 1  # encoder levels, bottom, decoder levels
    assert level[0].gives == ("skip0",) and level[-1].needs == ("skip0",)
    for seg in (level, cut_segments(layers, "block", owner=net),
                cut_segments(layers, "layers", every=5)):
        assert [s.start for s in seg[1:]] == [s.stop for s in seg[:-1]]
        assert seg[0].start == 0 and seg[-1].stop == len(layers)
    x = torch.randn(1, 3, 40, 56)
    with torch.enable_grad():
        out = apply_memory_mode(net, MemoryConfig("checkpoint", "layers", every=5))(x)
    assert torch.equal(out, run_layers(layers, x))


def test_checkpoint_under_ddp_matches_none():
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        net = tiny("same")
        x = torch.randn(1, 3, 48, 40)
        nn.parallel.DistributedDataParallel(net)(x).square().mean().backward()
        ref = grads(net)
        net.zero_grad(set_to_none=True)
        for cfg in (MemoryConfig("checkpoint"),
                    MemoryConfig("checkpoint", "strips", strip_rows=8, strip_cols=12)):
            net.zero_grad(set_to_none=True)
            ddp = nn.parallel.DistributedDataParallel(apply_memory_mode(net, cfg))
            ddp(x).square().mean().backward()  # strips: each weight's gradient arrives once
            assert_close(grads(net), ref)
    finally:
        dist.destroy_process_group()


def test_bad_memory_config_is_refused_with_the_key():
    with pytest.raises(ConfigError, match=r"memory.mode='swap'.*checkpoint_offload"):
        MemoryConfig("swap")
    with pytest.raises(ConfigError, match=r"memory.granularity='stage'"):
        MemoryConfig("checkpoint", granularity="stage")
    with pytest.raises(ConfigError, match=r"memory.every=0"):
        MemoryConfig("checkpoint", granularity="layers", every=0)
    with pytest.raises(ConfigError, match=r"memory.budget is not a memory key"):
        memory_config({"mode": "none", "budget": 3})
    with pytest.raises(ConfigError, match=r"Conv2d has no pipeline_layers"):
        apply_memory_mode(nn.Conv2d(1, 1, 3), "checkpoint")


def test_pipe_checkpoint_mode_follows_the_memory_mode():
    assert pipe_checkpoint_mode(MemoryConfig("none")) == "never"
    assert pipe_checkpoint_mode(MemoryConfig("offload")) == "never"
    assert pipe_checkpoint_mode(MemoryConfig("checkpoint")) == "except_last"
    last = MemoryConfig("checkpoint_offload", checkpoint_last=True)
    assert pipe_checkpoint_mode(last) == "always"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_modes_match_none_on_cuda():
    net = tiny("same").cuda()
    x = torch.randn(1, 3, 64, 48, device="cuda")
    net(x).square().mean().backward()
    ref = grads(net)
    for mode in ("offload", "checkpoint_offload"):
        net.zero_grad(set_to_none=True)
        apply_memory_mode(net, mode)(x).square().mean().backward()
        assert_close(grads(net), ref)


# ----- Lightning: the task trains the same under a memory mode, and reports it --------------


def _batches(n: int = 2) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"image": torch.randn(1, 3, 40, 56, generator=g),
             "target": torch.randint(0, 4, (1, 40, 56), generator=g),
             "norm": torch.tensor([40.0 * 56]), "last": torch.tensor([True])} for _ in range(n)]


def _fit(mode: str) -> tuple[dict[str, torch.Tensor], MemoryReport, pl.Trainer]:
    net = tiny("same")
    report = MemoryReport(mode)
    trainer = pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[report], accelerator="cpu")
    task = SegmentationTask(apply_memory_mode(net, mode), 4)
    trainer.fit(task, train_dataloaders=torch.utils.data.DataLoader(
        _batches(), batch_size=None))
    return net.state_dict(), report, trainer


def test_training_with_checkpointing_equals_none_and_reports_memory(capsys):
    ref, _, _ = _fit("none")
    got, report, trainer = _fit("checkpoint")
    for k in ref:
        assert torch.allclose(got[k], ref[k], atol=1e-6), k
    assert report.summary["steps"] == 2 and report.summary["memory_mode"] == "checkpoint"
    assert report.summary["peak_mem_mib"] > 50 and report.summary["mpix_per_s"] > 0
    assert "train/peak_mem_mib" in trainer.callback_metrics
    assert "memory=checkpoint precision=32-true: peak" in capsys.readouterr().out


# ----- precision ---------------------------------------------------------------------------


def test_precision_names_and_16_mixed_on_cpu_is_refused():
    assert check_precision("32", "cpu") == "32-true"
    assert check_precision("bf16", "cpu") == "bf16-mixed"
    assert check_precision("16-mixed", "gpu", cuda_available=True) == "16-mixed"
    with pytest.raises(ConfigError, match=r"16-mixed cannot run on this CPU.*bf16-mixed"):
        check_precision("16-mixed", "auto", cuda_available=False)
    with pytest.raises(ConfigError, match=r"trainer.precision='half'"):
        check_precision("half")


def test_old_and_new_precision_choices_compose():
    with initialize_config_dir(CONF, version_base="1.3"):
        for choice, name in [("'32'", "32-true"), ("32-true", "32-true"), ("bf16", "bf16-mixed"),
                             ("bf16-mixed", "bf16-mixed"), ("'16'", "16-mixed"),
                             ("16-mixed", "16-mixed")]:
            cfg = compose("train", overrides=[f"precision={choice}"])
            assert cfg.trainer.precision == name and cfg.memory.mode == "none"
        cfg = compose("train", overrides=["precision=16-mixed", "trainer.accelerator=cpu"])
    with pytest.raises(ConfigError, match="16-mixed cannot run"):
        check_memory(cfg)


def test_strip_blocks_compose_from_the_command_line():
    base = ["memory=checkpoint", "memory.granularity=strips"]
    with initialize_config_dir(CONF, version_base="1.3"):
        blocks = check_memory(compose("train", overrides=base))
        assert blocks.strip_cols == 1024 and blocks.label == "checkpoint:strips"
        assert MemoryConfig("checkpoint").label == "checkpoint"  # level: the default
        whole = check_memory(compose("train", overrides=[*base, "memory.strip_cols=null"]))
        assert whole.strip_cols is None and whole.strip_rows == 128
        bad = compose("train", overrides=[*base, "memory.strip_cols=9"])
    with pytest.raises(ConfigError, match=r"memory.strip_cols=9: use an even number"):
        check_memory(bad)


def test_bf16_tiled_labels_agree_with_untiled():
    net = tiny("same").eval()
    x = torch.randn(1, 3, 203, 171)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = predict_full(net, x).argmax(1)
    tiled = predict_tiled(net, x, q=3, autocast=torch.bfloat16).argmax(1)
    assert (tiled == full).float().mean().item() >= 0.999


# ----- the largest tile within a budget ----------------------------------------------------


def test_budget_below_the_smallest_tile_is_refused():
    with pytest.raises(ConfigError, match=r"memory.budget_gb=0.05 is too small.*smallest legal"):
        find_largest_tile(tiny(), int(0.05 * GIB), StepSpec(threads=1))


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
    dm = TileDataModule(str(tmp_path), net.footprint(), 4)
    with pytest.raises(ConfigError, match=r"tiling.tile_size=auto with tiling.q=2"):
        resolve_auto_tile(cfg, net, net.footprint(), dm, MemoryConfig())
    scene_files(tmp_path / "train", shape=(3, 203, 171), classes=4)
    with pytest.raises(ConfigError, match=r"needs a memory budget: set memory.budget_gb"):
        resolve_auto_tile(no_budget, net, net.footprint(), dm, MemoryConfig())


def test_auto_tile_size_fits_the_budget_measured_again(tmp_path, scene_files):
    scene_files(tmp_path / "train", shape=(3, 803, 771), classes=4)
    host = psutil.Process().memory_info().rss  # this process "trains": its size is reserved
    budget_gb = round((host + 140 * 2**20) / GIB, 3)
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=[
            "tiling=grid", "tiling.q=null", "tiling.tile_size=auto", "memory=none",
            f"memory.budget_gb={budget_gb}", "memory.rel_tol=0.5", "memory.max_probes=3",
            "model.in_channels=3", "model.num_classes=4", "task.channels_last=false"])
    net = tiny()
    fp = net.footprint()
    dm = TileDataModule(str(tmp_path), fp, 4, mode="grid", tile_size=None)
    memory = check_memory(cfg)
    resolve_auto_tile(cfg, net, fp, dm, memory)
    side = cfg.tiling.tile_size
    assert isinstance(side, int) and dm.tile_size == side and (side - 2 * fp.context) % 4 == 0
    again = measure_step(net, side, StepSpec(memory, threads=1))
    assert again.fits and again.peak_bytes + host - again.base_bytes <= budget_gb * GIB, again
    # larger tiles cut the halo overhead: E at the chosen tile beats the smallest legal tile's
    e_auto = make_grid(803, 771, fp, tile_size=side).efficiency
    assert e_auto < make_grid(803, 771, fp, tile_size=2 * fp.context + 4 * 8).efficiency
    assert math.isfinite(again.seconds)


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
