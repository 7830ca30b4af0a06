"""Stage-wise tiling (``predict_staged``): each stage tiled over whole maps == the untiled net."""

from __future__ import annotations

import pytest
import torch
from helpers.smp import assert_exact, lively, preset_model
from torch import nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.models.smp import SMPModel
from seg_at_scale.models.smp_stage_split import smp_stages
from seg_at_scale.tiling import predict_full
from seg_at_scale.tiling.staged import Chain, Stage, plan_stages, predict_staged, stage_halo
from seg_at_scale.tiling.statistic_passes import has_statistics

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _staged(net: SMPModel, x: torch.Tensor, budget: int, **kw) -> tuple[torch.Tensor, list]:
    stages = smp_stages(net)
    eff: list[float] = []
    y = predict_staged(stages, x, align=net.downsampling_factor, budget=budget,
                       efficiency=eff, **kw)
    return y, eff


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("preset", ["unet_test_resnet", "fpn_test_resnet",
                                    "deeplabv3plus_test_resnet"])
def test_staged_equals_untiled_with_every_stage_tiled(preset, layout, monkeypatch):
    """A budget small enough that the stem, the middle stages and the decoder run as
    several tiles (FPN's GroupNorms and DeepLab's image pooling then take the statistic
    passes over their stage's tiles), at sizes no multiple of 32: the untiled logits."""
    import seg_at_scale.tiling.staged.stages as staged

    passes: list[str] = []

    def counted(module, tiles, grid):
        passes.append(type(module).__name__)
        return real(module, tiles, grid)

    real = staged.fixed_statistics
    monkeypatch.setattr(staged, "fixed_statistics", counted)
    net = preset_model(preset)
    x = torch.randn(1, 4, 683, 589)
    ref = predict_full(net, x)  # contiguous: torch's whole-map GroupNorm in NHWC is itself
    cl = layout == "channels_last"  # 1.7e-5 off it, the passes' float64 sums 1e-6
    if cl:
        net = net.to(memory_format=torch.channels_last)
    y, eff = _staged(net, x, budget=40_000, channels_last=cl)
    with_sites = [st.name for st in smp_stages(net) if has_statistics(st.module)]
    assert (len(with_sites) > 0) == (preset != "unet_test_resnet")
    # the passes ran over tiles (FPN: at least its stride-4 and stride-8 GroupNorms)
    assert len(passes) >= min(len(with_sites), 3)
    assert sum(e > 1.0 for e in eff[:-1]) >= 3
    assert_exact(y, ref)


def test_deeplabv3_staged_by_aspp_branch_equals_untiled():
    """DeepLabV3 (no fusion): its ASPP as a stage per branch reach, then projection, conv
    and head in one; dilated stride-8 encoder; the untiled logits."""
    torch.manual_seed(0)
    net = lively(SMPModel("DeepLabV3", "tu-test_resnet", in_channels=4, num_classes=3,
                          options={"decoder_channels": 32}))
    x = torch.randn(1, 4, 421, 389)
    with torch.no_grad():  # centre the logits: a random DeepLabV3 labels one class only
        net.net.segmentation_head[0].bias.sub_(predict_full(net, x).mean((0, 2, 3)))
    stages = smp_stages(net)
    assert [s.name for s in stages[-5:]] == [
        "decoder.aspp.local", "decoder.aspp.rate12", "decoder.aspp.rate24",
        "decoder.aspp.rate36", "decoder.aspp.project+conv+head"]
    y, eff = _staged(net, x, budget=20_000)
    assert sum(e > 1.0 for e in eff) >= 3
    assert_exact(y, predict_full(net, x))


@pytest.mark.parametrize("arch", ["DeepLabV3Plus", "DeepLabV3"])
def test_aspp_rate_stages_compute_only_their_cores(arch, monkeypatch):
    """The dilated branches' stages compute their tiles' cores alone (``core_of``: the
    pointwise / full convolution not on the rate-36 halo); tiles inside the map and at its
    edges, channels-last with DeepLabV3+'s NCHW separable blocks; the untiled logits."""
    import seg_at_scale.models.smp_stage_split as mod

    calls: list[tuple[int, int, int, int]] = []

    def recorded(block, x, rows, cols):
        calls.append((rows.stop - rows.start, x.shape[-2], rows.start, cols.start))
        return real(block, x, rows, cols)

    real = mod.core_of
    monkeypatch.setattr(mod, "core_of", recorded)
    torch.manual_seed(0)
    net = lively(SMPModel(arch, "tu-test_resnet", in_channels=4, num_classes=3,
                          options={"decoder_channels": 32}))
    # the rate-12 stage's tiles need cores of 4 x 208 px; the input not centred on zero, as
    # a normalised scene is not, so a wrong zero at a map edge shows
    x = torch.randn(1, 4, 1061, 913) + 0.8
    with torch.no_grad():  # centre the logits: a random DeepLab labels one class only
        net.net.segmentation_head[0].bias.sub_(predict_full(net, x).mean((0, 2, 3)))
    ref = predict_full(net, x)
    net = net.to(memory_format=torch.channels_last)
    rates = [s for s in smp_stages(net) if ".rate" in s.name]
    assert len(rates) == 3 and all(s.module.computes_core for s in rates)
    y, _ = _staged(net, x, budget=12_000, channels_last=True)
    assert_exact(y, ref)
    assert any(core < window for core, window, _, _ in calls)  # the halo not computed
    assert any(r == 0 for _, _, r, _ in calls) and any(r > 0 for _, _, r, _ in calls)


def test_staged_runs_the_deep_stages_whole_and_equals_untiled_unbatched_width():
    """With the default budget a small scene is one tile per stage (E = 1): the untiled
    forward computed stage by stage; a batch of two images is predicted as two."""
    net = preset_model("unet_test_resnet")
    x = torch.randn(2, 4, 301, 227)
    y, eff = _staged(net, x, budget=1 << 27)
    assert eff == [1.0] * len(eff)
    assert_exact(y, predict_full(net, x))


def test_a_transformer_style_encoder_with_its_empty_stride_2_map(monkeypatch):
    """A timm encoder without a stride-2 feature (ConvNeXt) gets smp's empty placeholder
    as a stage of its own, and the decoder still receives every map in smp's order. The
    placeholder stage reads nothing: it had no channels to budget, so it read the whole
    image as one tile (2.4 GB of a 12288^2 scene from the file)."""
    import seg_at_scale.tiling.staged.stages as staged

    torch.manual_seed(0)
    net = lively(SMPModel("Unet", "tu-test_convnext", in_channels=4, num_classes=3,
                          options={"decoder_channels": [16, 16, 8, 8, 8]}))
    stages = smp_stages(net)
    assert stages[0].name == "encoder.empty" and stages[1].inputs == (0,)
    reads = []
    real = staged.read_map
    monkeypatch.setattr(staged, "read_map", lambda m, rows, cols: reads.append(
        (rows.stop - rows.start, cols.stop - cols.start)) or real(m, rows, cols))
    x = torch.randn(1, 4, 421, 357)
    # the encoder's ConvNeXt blocks compute their tiles' cores, each block on a window
    # shrinking to it (tiling.staged.core_only.shrinking): inside the map and at its edges
    import seg_at_scale.tiling.staged.core_only as core

    sides: list[tuple[bool, ...]] = []
    shrink = core.shrinking
    monkeypatch.setattr(core, "shrinking", lambda chain, x, rows, cols, edges: sides.append(
        edges) or shrink(chain, x, rows, cols, edges))
    assert [type(s.module).__name__ for s in stages[1:5]] == ["Shrinking"] * 4
    y, eff = _staged(net, x, budget=60_000)
    assert max(eff) > 1.0
    assert_exact(y, predict_full(net, x))
    assert (False, False, False, False) in sides and (True, False, True, False) in sides
    extended = -(-421 // 32) * 32  # the image extended to the alignment: 448 rows
    assert reads and max(h for h, _ in reads) < extended  # no stage read the whole image


def test_a_dilated_stage_is_probed_where_its_taps_land():
    """A stride-16 stage with a rate-36 convolution (DeepLab's ASPP) reaches 36 * 16 px.
    A probe of a few map pixels reads only padding there and found no reach (was: halo 0,
    and a DeepLabV3+ decoder tiled with it gave 1112 wrong labels)."""
    conv = Chain(nn.Conv2d(2, 2, 3, padding=36, dilation=36))
    halo, used = stage_halo(conv, [16], [2], out_stride=16, align=16)
    assert (halo, used) == (36 * 16, (True,))


def test_the_plan_finds_which_maps_the_decoder_reads():
    """smp's U-Net decoder takes the input image for its shape only; DeepLab's decoder is
    ASPP on the last map, then the fusion with the stride-4 map: the others are dropped
    once consumed."""
    unet = smp_stages(preset_model("unet_test_resnet"))
    plan = plan_stages(unet, 4, 32)
    assert plan.used[-1] == (False, True, True, True, True, True)
    assert plan.strides == (1, 2, 4, 8, 16, 32, 1)
    dl = smp_stages(preset_model("deeplabv3plus_test_resnet"))
    # nothing but the next stages read the stem's stride-2 map: the stem runs inside them
    assert dl[0].name == "encoder.conv1..act1+maxpool..layer1" and dl[2].inputs == (1,)
    # the fusion reads the stride-4 map through block1, which runs as soon as it is written
    assert [(s.name, s.inputs) for s in dl[1:3]] == [("decoder.block1", (1,)),
                                                     ("encoder.layer2", (1,))]
    assert [(s.name, s.inputs) for s in dl[-6:]] == [
        ("decoder.aspp.local", (5,)), ("decoder.aspp.rate2", (5,)),
        ("decoder.aspp.rate4", (5,)), ("decoder.aspp.rate6", (5,)),
        ("decoder.aspp.project", (6, 7, 8, 9)), ("decoder.fuse+head", (10, 2))]
    plan = plan_stages(dl, 4, 16)
    assert plan.strides[:-1] == (1, 4, 4, 8, 16) + (16,) * 6
    assert plan.channels[2] == 48 and plan.used[-1] == (True, True)
    # the deepest map is read by every branch; the stride-4 map is dropped after layer2,
    # block1's 48 channels wait for the fusion
    assert plan.last_reads(dl) == {0: 0, 1: 2, 2: 10, 3: 3, 4: 4, 5: 8, 6: 9, 7: 9, 8: 9,
                                   9: 9, 10: 10}
    # each branch's halo is its own reach, not the widest's; only the branch stage that
    # holds the image pooling has a statistic (takes passes)
    halos = [f.halo for f in plan.footprints[5:9]]
    assert halos == sorted(halos) and halos[0] == 0 and halos[1] < halos[3]
    assert [has_statistics(s.module) for s in dl[5:11]] == [True] + [False] * 5
    # a U-Net's decoder reads the stride-2 map: its stem stays a stage of its own
    assert [s.name for s in unet[:2]] == ["encoder.conv1..act1", "encoder.maxpool..layer1"]


def test_stage_of_a_network_reading_the_whole_input_is_refused():
    """Squeeze-excitation inside an encoder gates a stage with its tile's mean: refused
    before any work, naming the module (the exact-tiling refusal)."""
    net = SMPModel("Unet", "tu-test_efficientnet", in_channels=4, num_classes=3,
                   options={"decoder_channels": [16, 16, 8, 8, 8]})
    with pytest.raises(ConfigError, match=r"staged=true: net\.encoder\.model\.blocks.*"
                                          r"squeeze-excitation"):
        smp_stages(net)


def test_an_encoder_of_unknown_stages_is_refused():
    net = SMPModel("Unet", "mobilenet_v2", in_channels=4, num_classes=3)
    with pytest.raises(ConfigError, match=r"staged=true: the encoder MobileNetV2Encoder "
                                          r"is not one whose stages are known.*staged=false"):
        smp_stages(net)


def test_a_stage_list_in_image_order():
    """Generic stages (not smp): a downsampling stage, then one that reads both maps."""

    class Merge(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(5, 2, 3, padding=1)

        def forward(self, xs):
            x, low = xs
            up = nn.functional.interpolate(low, scale_factor=2.0, mode="nearest")
            return self.conv(torch.cat([x, up], 1))

    torch.manual_seed(0)
    down = Chain(nn.Conv2d(1, 4, 3, 2, 1), nn.ReLU(), nn.Conv2d(4, 4, 5, padding=2))
    merge = Merge()
    stages = [Stage("down", down, (0,), 2), Stage("merge", merge, (0, 1), 1)]
    x = torch.randn(1, 1, 97, 131)
    xe = nn.functional.pad(x, (0, 1, 0, 1))
    with torch.no_grad():
        ref = merge([xe, down([xe])])[..., :97, :131]
    eff: list[float] = []
    y = predict_staged(stages, x, align=2, budget=3_000, efficiency=eff)
    assert min(eff) > 1.0
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=0)


def test_maps_in_files_give_the_same_logits_and_leave_nothing(tmp_path):
    """``store=``: the maps between stages live in files read window by window; the
    logits are bit-identical to the in-memory run and the files are gone afterwards."""
    net = preset_model("deeplabv3plus_test_resnet")
    x = torch.randn(1, 4, 517, 461)
    mem, _ = _staged(net, x, budget=40_000, channels_last=True)
    disk, eff = _staged(net, x, budget=40_000, channels_last=True, store=tmp_path)
    assert max(eff) > 1.0
    assert torch.equal(disk, mem)
    assert list(tmp_path.iterdir()) == []


def test_a_failing_stage_leaves_no_map_files(tmp_path):
    """An error in a later stage (here: the decoder) removes the maps already written."""
    net = preset_model("unet_test_resnet")
    stages = smp_stages(net)

    def fail(*_):
        raise RuntimeError("boom in the decoder")

    stages[-1].module.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        predict_staged(stages, torch.randn(1, 4, 200, 200), align=32, budget=40_000,
                       store=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_plan_is_the_same_under_inference_mode():
    """The halo probe back-propagates: under ``torch.inference_mode`` (as seg-predict runs)
    it found no gradient and every halo 0 (was: 3.8 logits off), as under no mode at all."""
    stages = smp_stages(preset_model("unet_test_resnet"))
    plain = plan_stages(stages, 4, 32)
    with torch.inference_mode():
        assert plan_stages(stages, 4, 32) == plain
    assert min(f.halo for f in plain.footprints) > 0


def test_statistic_levels_are_found_under_inference_mode():
    """FPN's three GroupNorm levels depend on one another; under inference_mode autograd
    saw no path and put every site on level 1 (was: 2 % of a staged COG's labels wrong)."""
    from seg_at_scale.tiling.statistic_layers import site_levels

    net = preset_model("fpn_test_resnet")
    x = torch.zeros(1, 4, 64, 64)
    plain = site_levels(net, x)
    with torch.inference_mode():
        assert site_levels(net, x) == plain
    assert max(plain.values()) == 3


def test_the_bf16_fast_path_runs_the_statistic_passes_on_bf16_maps():
    """Under autocast the maps are bf16; FPN's passes over the decoder's tiles ran outside
    autocast and failed on them (was: 'Input type BFloat16 and bias type float'). The fast
    path is not exact: its labels agree with fp32's on most pixels."""
    net = preset_model("fpn_test_resnet")
    x = torch.randn(1, 4, 683, 589)
    exact, _ = _staged(net, x, budget=40_000)
    fast, eff = _staged(net, x, budget=40_000, autocast=torch.bfloat16, channels_last=True)
    assert eff[-1] > 1.0
    assert (fast.argmax(1) == exact.argmax(1)).float().mean() > 0.9


def test_fpn_stores_each_block_map_before_its_upsampling():
    """A segmentation block's 2x upsampling runs in the stage reading its map (the next
    convolution, or the merge): every GroupNorm stage writes at its convolution's stride, so
    the merge reads three stride-8 maps and the stride-4 one (all four at stride 4 before:
    4x the bytes for three of them)."""
    net = preset_model("fpn_test_resnet")
    stages = smp_stages(net)
    plan = plan_stages(stages, 4, net.downsampling_factor)
    norms = [k for k, st in enumerate(stages) if st.name.endswith(".norm")]
    assert len(norms) == 7
    assert all(plan.strides[k + 1] == plan.strides[stages[k].inputs[0]] for k in norms)
    assert sorted(plan.strides[i] for i in stages[-1].inputs) == [4, 8, 8, 8]


def test_the_heap_is_given_back_after_the_plan_and_every_stage(monkeypatch):
    """glibc keeps a finished stage's freed tiles for later allocations, which the next
    stage's other shapes cannot reuse: the process then held every stage's peak at once.
    The trim runs after the probes and after each stage; on glibc it reports that it ran."""
    import platform

    import seg_at_scale.tiling.staged.stages as staged

    ran: list[int] = []
    real = staged.give_back_heap
    monkeypatch.setattr(staged, "give_back_heap", lambda: ran.append(1) or real())
    net = preset_model("unet_test_resnet")
    stages = smp_stages(net)
    _staged(net, torch.randn(1, 4, 97, 83), budget=1 << 27)
    assert len(ran) == len(stages) + 1
    assert real() is (platform.libc_ver()[0] == "glibc")
