"""Memory modes give `none`'s numbers: untiled, tiled, UResNet, DDP, Pipe; strips' bounds."""


from __future__ import annotations

import copy
import inspect
import os
import pickle
import typing

import pytest
import torch
from helpers.memory import CONFIGS, assert_close, grads, saved_bytes, tiny
from helpers.smp import preset_model
from torch import nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.memory import (
    MemoryConfig,
    apply_memory_mode,
    memory_config,
    pipe_checkpoint_mode,
)
from seg_at_scale.memory.segments import cut_segments
from seg_at_scale.models import UNet, UResNet
from seg_at_scale.models.contract import CAPABILITIES, SegmentationNetwork
from seg_at_scale.models.gscnn import GSCNN
from seg_at_scale.models.layers import run_layers
from seg_at_scale.tasks.losses import CrossEntropy
from seg_at_scale.tiling import footprint, tiled_backward
from seg_at_scale.tiling.halo import Aligned, Footprinted
from seg_at_scale.tiling.statistics import ImagePooled

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

    def saved(cfg: MemoryConfig) -> int:  # less the image
        return saved_bytes(lambda: apply_memory_mode(net, cfg)(x).sum()) - x.numel() * 4

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


def _static_isinstance(obj: object, protocol: type) -> bool:
    """``isinstance`` against a runtime protocol as Python 3.12 and later check it, on any
    Python: each member looked up with ``inspect.getattr_static`` (no ``__getattr__``)."""
    missing = object()
    return all(inspect.getattr_static(obj, m, missing) is not missing
               for m in typing._get_protocol_attrs(protocol))  # type: ignore[attr-defined]


PROTOCOLS = [SegmentationNetwork, *CAPABILITIES, Footprinted, Aligned, ImagePooled]


@pytest.mark.parametrize("family", ["unet", "smp", "gscnn"])
def test_wrapped_model_keeps_every_capability_under_static_protocol_checks(family):
    """The wrapper is what training tiles: Python >= 3.12 checks the model contract without
    ``__getattr__``, and a wrapper that only delegated lost its footprint and alignment
    there (the halo probe then ran at alignment 1: every memory mode failed on a GPU
    machine's Python 3.12). Here the 3.12 rule is applied on any Python."""
    net = {"unet": lambda: tiny("same"),
           "smp": lambda: preset_model("unet_test_resnet"),
           "gscnn": lambda: GSCNN(in_channels=3, num_classes=4, stem_width=4,
                                            widths=(4, 4, 8, 8), shape_widths=(4, 4, 4),
                                            aspp_width=4, decoder_width=4)}[family]()
    has = [p.__name__ for p in PROTOCOLS if _static_isinstance(net, p)]
    assert [p.__name__ for p in PROTOCOLS if isinstance(net, p)] == has
    assert "SegmentationNetwork" in has
    for mode in ("checkpoint", "offload", "checkpoint_offload"):
        wrapped = apply_memory_mode(net, MemoryConfig(mode, granularity="level"))
        assert [p.__name__ for p in PROTOCOLS if _static_isinstance(wrapped, p)] == has, mode
        assert [p.__name__ for p in PROTOCOLS if isinstance(wrapped, p)] == has, mode
        assert footprint(wrapped) == footprint(net)
        again = copy.deepcopy(wrapped)  # the per-model class survives a copy and a pickle
        assert type(again) is not type(wrapped) and again.memory == wrapped.memory
        assert [p.__name__ for p in PROTOCOLS if _static_isinstance(again, p)] == has
        assert pickle.loads(pickle.dumps(wrapped)).footprint() == net.footprint()


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


