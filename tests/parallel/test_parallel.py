"""Pipelines, sample parallelism and both: identical outputs and exact gradients.

Multi-process cases spawn 2 gloo processes on this CPU. Sizes are not round numbers:
batches of 3 split into 2 micro-batches, 9 tiles over 2 ranks, images of 181 x 203.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from seg_at_scale.data.samplers import ShardedImageSampler
from seg_at_scale.errors import ConfigError
from seg_at_scale.models import UNet
from seg_at_scale.models.layers import check_layers, run_layers
from seg_at_scale.parallel.launch import all_reduce_gradients, cpu_threads, spawn
from seg_at_scale.parallel.pipe import PipelineConfig, build_pipe
from seg_at_scale.parallel.planner import bubble_fraction, partition, plan, predict
from seg_at_scale.parallel.profile import LayerCost, profile_layers
from seg_at_scale.tasks.losses import CrossEntropy
from seg_at_scale.tiling import tiled_backward
from seg_at_scale.tiling.predict import extend

torch.set_num_threads(1)


def unet(padding: str = "valid", up: str = "transpose", seed: int = 0) -> UNet:
    torch.manual_seed(seed)
    return UNet(3, 4, levels=3, convs_per_level=2, base_width=4, padding=padding,
                upsample=up).double()


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def assert_grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                       rtol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        err = (a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)
        assert err <= rtol, f"{k}: relative error {err:.2e}"


# ----- flat form and Pipe -------------------------------------------------------------


@pytest.mark.parametrize(("padding", "up"), [("valid", "transpose"), ("same", "nearest"),
                                             ("same", "bilinear")])
def test_flat_layers_equal_model(padding: str, up: str) -> None:
    net = unet(padding, up)
    layers = net.pipeline_layers()
    check_layers(layers)
    x = torch.randn(2, 3, 108 if padding == "valid" else 44, 92 if padding == "valid" else 52,
                    dtype=torch.float64)
    assert torch.equal(run_layers(layers, x), net(x))


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_pipe_three_stages_equals_model(checkpoint: str) -> None:
    net = unet("valid")
    x = torch.randn(3, 3, 108, 100, dtype=torch.float64)  # 3 samples in 2 micro-batches
    ref = net(x)
    ref.pow(2).sum().backward()
    g_ref = grads(net)
    net.zero_grad(set_to_none=True)
    n = len(net.pipeline_layers())
    pipe = build_pipe(net, PipelineConfig([5, n - 12, 7], ["cpu"] * 3, chunks=2,
                                          checkpoint=checkpoint))
    y = pipe(x)
    assert (y - ref).abs().max() <= 1e-12 * ref.abs().max()
    y.pow(2).sum().backward()
    assert_grads_close(grads(net), g_ref, 1e-10)


def test_pipe_shares_the_models_parameters() -> None:
    net = unet("same")
    pipe = build_pipe(net, PipelineConfig([9, len(net.pipeline_layers()) - 9], ["cpu", "cpu"]))
    assert {id(p) for p in pipe.parameters()} == {id(p) for p in net.parameters()}


@pytest.mark.parametrize(("cfg", "message"), [
    (PipelineConfig([5, 5], ["cpu", "cpu"]), "sums to 10, but the model has 27"),
    (PipelineConfig([5, 10, 12], ["cpu", "cpu"]), "2 device(s) for 3 stages"),
    (PipelineConfig([13, 14], ["cpu", "cuda:7"]), "'cuda:7' does not exist"),
    (PipelineConfig([13, 14], ["cpu", "cpu"], chunks=4), "chunks=4 > batch size 2"),
    (PipelineConfig([13, 14], ["cpu", "cpu"], checkpoint="sometimes"), "checkpoint='sometimes'"),
])
def test_bad_pipeline_config_is_refused(cfg: PipelineConfig, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_pipe(unet("valid"), cfg, batch_size=2)


# ----- sampling -----------------------------------------------------------------------


@pytest.mark.parametrize(("tiles", "world"), [(9, 2), (4, 3), (2, 3), (7, 7)])
def test_sharded_sampler_covers_each_tile_once(tiles: int, world: int) -> None:
    groups = [list(range(tiles)), list(range(tiles, 2 * tiles + 1))]
    per_rank = [list(ShardedImageSampler(groups, r, world, seed=3)) for r in range(world)]
    assert len({len(s) for s in per_rank}) == 1  # same number of slots: same all-reduces
    real = sorted(i for s in per_rank for i, _ in s if i >= 0)
    assert real == list(range(2 * tiles + 1))
    for s in per_rank:  # exactly one `last` per image, at the same slot on every rank
        assert [k for k, (_, last) in enumerate(s) if last] == \
            [k for k, (_, last) in enumerate(per_rank[0]) if last]
        assert sum(last for _, last in s) == 2


# ----- sample parallelism and the hybrid (2 gloo processes) -------------------------


def _whole_image_case() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    image = torch.randn(1, 3, 181, 203, generator=g, dtype=torch.float64)
    target = torch.randint(0, 4, (1, 181, 203), generator=g)
    target[0, :20, :30] = 255
    return image, target


def _rank_gradients(rank: int, world: int, out: str, stages: int) -> None:
    net = unet("same", seed=1)
    image, target = _whole_image_case()
    fp = net.footprint()
    model: nn.Module = net
    if stages > 1:
        n = len(net.pipeline_layers())
        model = build_pipe(net, PipelineConfig([n // 2, n - n // 2], ["cpu"] * 2))
    tiled_backward(model, image, target, CrossEntropy(4), q=3, fp=fp, shard=(rank, world))
    all_reduce_gradients(net.parameters(), "sum")
    if rank == 0:
        torch.save(grads(net), out)


@pytest.mark.parametrize("stages", [1, 2], ids=["sample_parallel", "hybrid_2x2_pipe"])
def test_two_process_gradients_equal_whole_image(tmp_path: Path, stages: int) -> None:
    out = str(tmp_path / "grads.pt")
    spawn(_rank_gradients, 2, out, stages)
    net = unet("same", seed=1)
    image, target = _whole_image_case()
    fp = net.footprint()
    logits = net(extend(image, fp))[..., :181, :203]  # the untiled forward
    s, w = CrossEntropy(4)(logits, target)
    (s / w).backward()
    assert_grads_close(torch.load(out), grads(net), 1e-10)


# ----- planner ------------------------------------------------------------------------


def _costs(times: list[float], act: int = 1000, params: int = 100) -> list[LayerCost]:
    return [LayerCost(f"{i}", t, 2 * t, act, act // 2, 0, params) for i, t in enumerate(times)]


@pytest.mark.parametrize(("k", "m"), [(2, 1), (3, 4), (6, 7)])
def test_predicted_bubble_matches_gpipe_formula(k: int, m: int) -> None:
    costs = _costs([0.01] * (6 * k))
    p = predict(costs, [6] * k, [f"cuda:{i}" for i in range(k)], m, "never", batch=m)
    assert p.bubble == pytest.approx((k - 1) / (m + k - 1))
    ideal = m * (0.06 + 0.12)  # m micro-batches through one stage, fwd + bwd
    assert p.step_s == pytest.approx(ideal / (1 - bubble_fraction(k, m)))


def test_partition_minimises_the_slowest_stage() -> None:
    w = [5, 1, 1, 1, 5, 2, 2, 1]
    best = partition(w, 3)
    assert best is not None and sum(best) == len(w)
    sums = [sum(w[a : a + b]) for a, b in zip([0, best[0], best[0] + best[1]], best)]
    assert max(sums) == 7  # brute force: no contiguous 3-split does better
    assert partition(w, 2, fits=lambda a, b: b - a <= 3) is None


@pytest.mark.parametrize("cap_gb", [3e-5, 5e-5, 1e-4])
def test_plan_never_exceeds_its_memory_cap(cap_gb: float) -> None:
    costs = _costs([0.01 * (1 + i % 3) for i in range(24)], act=4000, params=50)
    p = plan(costs, [f"cuda:{i}" for i in range(8)], batch=8, memory_cap_gb=cap_gb)
    assert p.peak_bytes <= cap_gb * 2**30
    assert sum(p.balance) == 24


def test_plan_refuses_an_impossible_cap() -> None:
    with pytest.raises(ConfigError, match="no pipeline of <= 2 stages fits"):
        plan(_costs([0.01] * 6, act=10**9), ["cuda:0", "cuda:1"], batch=4, memory_cap_gb=0.5)


def test_profile_handles_skip_layers() -> None:
    net = unet("valid").float()
    costs = profile_layers(net.pipeline_layers(), torch.randn(1, 3, 108, 100), repeats=1)
    assert len(costs) == len(net.pipeline_layers())
    assert sum(c.param_bytes for c in costs) == sum(4 * p.numel() for p in net.parameters())
    assert sum(c.stash_bytes > 0 for c in costs) == net.levels - 1
    assert all(c.forward_s > 0 for c in costs)


def _model(kind: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(2)
    if kind == "uresnet":
        from seg_at_scale.models.uresnet import URESNET_SIZES, UResNet

        net: nn.Module = UResNet(planes=3, num_classes=3, batch_norm=False,
                                 **URESNET_SIZES["tiny"].kwargs())
        return net.double(), torch.randn(3, 3, 44, 52, dtype=torch.float64)
    from seg_at_scale.models.gscnn import GSCNN, GSCNN_SIZES

    size = GSCNN_SIZES["tiny"]
    net = GSCNN(4, 5, stem_width=size.stem_width, widths=size.widths, blocks=size.blocks,
                shape_widths=size.shape_widths, aspp_width=size.aspp_width,
                aspp_rates=size.aspp_rates, decoder_width=size.decoder_width, norm="none",
                output="packed")
    return net.double(), torch.randn(3, 4, 48, 56, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["uresnet", "gscnn"])
def test_every_model_runs_as_a_pipe(kind: str) -> None:
    """UResNet (planes folded, joined deepest) and Gated-SCNN (side features, shape stream)."""
    net, x = _model(kind)
    ref = net(x)
    ref.pow(2).sum().backward()
    g_ref = grads(net)
    net.zero_grad(set_to_none=True)
    n = len(net.pipeline_layers())
    pipe = build_pipe(net, PipelineConfig([n // 3, n // 3, n - 2 * (n // 3)], ["cpu"] * 3,
                                          chunks=2, checkpoint="except_last"))
    y = pipe(x)
    assert (y - ref).abs().max() <= 1e-12 * ref.abs().max()
    y.pow(2).sum().backward()
    assert_grads_close(grads(net), g_ref, 1e-9)


def test_auto_pipeline_plans_under_a_cap_from_a_measured_profile() -> None:
    from seg_at_scale.parallel.setup import resolve_pipeline

    net = UNet(4, 5, levels=3, convs_per_level=2, base_width=8, padding="same")
    p = {"mode": "auto", "stages": 2, "devices": ["cpu", "cpu"], "balance_by": "plan",
         "memory_cap_gb": 0.05, "repeats": 1}
    cfg = resolve_pipeline(p, net, (4, 64, 72), batch_size=4)
    assert cfg is not None and sum(cfg.balance) == len(net.pipeline_layers())
    assert 4 % cfg.chunks == 0 and cfg.source["predicted_peak_gb"] <= 0.05
    with pytest.raises(ConfigError, match="fits 1e-06 GB per device"):
        resolve_pipeline({**p, "memory_cap_gb": 1e-6}, net, (4, 64, 72), batch_size=4)


def test_pipeline_group_is_validated_once_with_the_key_named() -> None:
    from seg_at_scale.parallel.setup import pipeline_group, resolve_pipeline

    with pytest.raises(ConfigError, match="pipeline.chunk is not a pipeline key"):
        pipeline_group({"mode": "manual", "chunk": 2})
    with pytest.raises(ConfigError, match="pipeline.mode='gpipe'"):
        pipeline_group({"mode": "gpipe"})
    net = UNet(4, 5, levels=3, convs_per_level=2, base_width=8, padding="same")
    layers = len(net.pipeline_layers())
    g = {"mode": "manual", "balance": [layers - 4, 4], "devices": ["cpu", "cpu"]}
    with pytest.raises(ConfigError, match="pipeline=manual needs pipeline.chunks"):
        resolve_pipeline(g, net, (4, 64, 72), batch_size=4)  # no default written in code
    cfg = resolve_pipeline({**g, "chunks": 2, "checkpoint": "never"}, net, (4, 64, 72), 4)
    assert cfg is not None and (cfg.chunks, cfg.checkpoint) == (2, "never")


def test_cpu_threads_follow_omp_num_threads_then_the_cpus_this_process_may_use(monkeypatch):
    """A Slurm task's --cpus-per-task (OMP_NUM_THREADS), else its affinity: not the node's
    core count, which gave every rank of a Slurm job all the node's cores."""
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert (cpu_threads(1), cpu_threads(2), cpu_threads(16)) == (8, 4, 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(2) == 3


def test_a_group_made_inside_is_destroyed_on_leaving_and_the_callers_group_stays(tmp_path):
    """``group_of_its_own`` (around ``fit``): the group Lightning makes inside is gone
    after it (a gloo group left to the interpreter's exit can abort a finished rank); a
    group the caller had made before stays theirs."""
    import torch.distributed as dist

    from seg_at_scale.parallel.launch import group_of_its_own

    def one_rank_group(name: str) -> None:
        store = dist.FileStore(str(tmp_path / name), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)

    with group_of_its_own():
        one_rank_group("inside")
        assert dist.is_initialized()
    assert not dist.is_initialized()
    one_rank_group("callers")
    try:
        with group_of_its_own():
            pass
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
