"""memory=checkpoint on smp networks: stages or building blocks recomputed, gradients unchanged."""

from __future__ import annotations

import copy

import pytest
import pytorch_lightning as pl
import torch
from helpers.memory import saved_bytes
from helpers.smp import TEST_PRESETS, preset_model

from seg_at_scale.errors import ConfigError
from seg_at_scale.memory import MemoryConfig, apply_memory_mode
from seg_at_scale.memory.block_checkpoint import find_units
from seg_at_scale.tasks import SegmentationTask


def _first_leaf(unit: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in unit.modules() if next(m.children(), None) is None
                and next(m.parameters(), None) is not None)


def _step(net: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(7)  # FPN's decoder has dropout: the same mask in both runs
    y = net(x)
    (y.square().mean() + y[:, 0, 5:40, 7:50].mean()).backward()
    return y.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("granularity", ["level", "block"])
@pytest.mark.parametrize("preset", TEST_PRESETS)
def test_checkpointed_smp_equals_plain_and_recomputes_each_unit(preset, granularity):
    """Train-mode BatchNorm on purpose: outputs, gradients and running statistics equal."""
    net = preset_model(preset).train()
    plain = copy.deepcopy(net)
    x = torch.randn(2, 4, 96, 160, generator=torch.Generator().manual_seed(3))
    ref_y, ref_g = _step(plain, x)

    wrapped = apply_memory_mode(net, MemoryConfig("checkpoint", granularity))
    units = find_units(net.checkpoint_roots(), granularity)
    calls = [0] * len(units)
    for k, unit in enumerate(units):
        _first_leaf(unit).register_forward_hook(
            lambda *_, k=k: calls.__setitem__(k, calls[k] + 1))
    y, g = _step(wrapped, x)

    assert torch.equal(y, ref_y)
    assert g.keys() == ref_g.keys() and len(g) > 20
    scale = max(float(t.abs().max()) for t in ref_g.values())
    for name, t in g.items():
        assert torch.allclose(t, ref_g[name], rtol=1e-5, atol=1e-6 * scale), name
    for name, b in net.state_dict().items():  # one momentum update, not two
        assert torch.equal(b, plain.state_dict()[name]) or name.startswith("input_"), name
    # forward, then the recomputation (FPN's lateral 1x1 blocks keep only their inputs,
    # which checkpointing holds anyway: nothing to recompute there)
    assert max(calls) == 2 and calls.count(2) >= 0.6 * len(units), calls
    assert calls[-1] == 1  # the last unit runs plainly (memory.checkpoint_last=false)
    assert "forward" not in units[0].__dict__  # the modules are left as they were


def test_checkpointing_holds_less_for_the_backward_pass():
    net = preset_model("unet_test_resnet").train()
    x = torch.randn(1, 4, 128, 192)

    def saved(mode: MemoryConfig) -> int:
        return saved_bytes(lambda: apply_memory_mode(net, mode)(x).sum())

    none = saved(MemoryConfig("none"))
    level = saved(MemoryConfig("checkpoint", "level"))
    block = saved(MemoryConfig("checkpoint", "block"))
    assert level < 0.5 * none and block < 0.5 * none, (none, level, block)


def test_training_an_smp_model_under_checkpointing_equals_none():
    def fit(mode: str) -> dict[str, torch.Tensor]:
        net = preset_model("fpn_test_resnet").train()
        g = torch.Generator().manual_seed(1)
        batches = [{"image": torch.randn(1, 4, 64, 96, generator=g),
                    "target": torch.randint(0, 5, (1, 64, 96), generator=g),
                    "norm": torch.tensor([64.0 * 96]), "last": torch.tensor([True])}
                   for _ in range(2)]
        task = SegmentationTask(apply_memory_mode(net, MemoryConfig(mode, "block")), 5,
                                gradient_reduction="mean")
        torch.manual_seed(5)  # FPN's dropout draws the same masks in both fits
        pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False,
                   accelerator="cpu").fit(task, torch.utils.data.DataLoader(batches,
                                                                            batch_size=None))
        return net.state_dict()

    ref, got = fit("none"), fit("checkpoint")
    start = preset_model("fpn_test_resnet").state_dict()
    changed = [k for k in ref if not torch.equal(ref[k], start[k])]
    assert len(changed) > 20  # the steps moved the weights
    for k in ref:
        assert torch.allclose(got[k], ref[k], atol=1e-6, equal_nan=True), k


@pytest.mark.parametrize("granularity", ["strips", "layers"])
def test_granularities_of_the_flat_form_are_refused_with_the_fix(granularity):
    net = preset_model("unet_test_resnet")
    with pytest.raises(ConfigError, match=rf"memory.granularity={granularity}: SMPModel has "
                       r"no flat layer form.*memory.granularity=level.*granularity=block"):
        apply_memory_mode(net, MemoryConfig("checkpoint", granularity))
