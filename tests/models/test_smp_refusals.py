"""Networks that need the whole input: refused under exact tiling; what blending costs."""

from __future__ import annotations

import pytest
import torch
from helpers.smp import lively, preset_model

from seg_at_scale.errors import ConfigError, InputError
from seg_at_scale.models.registry import build_model
from seg_at_scale.models.smp import SMPModel
from seg_at_scale.tiling import predict_full
from seg_at_scale.tiling.blend import label_deviation, predict_blended, window_starts
from seg_at_scale.tiling.halo import WholeImageDependency, empirical_halo

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("arch,encoder,module,kind", [
    ("Unet", "tu-test_efficientnet", r"net\.encoder\.model\.blocks\.\d\.\d\.se",
     "squeeze-excitation"),
    ("Unet", "mit_b0", r"net\.encoder\.block1\.0\.attn", "attention"),
    ("PSPNet", "tu-test_resnet", r"net\.decoder\.psp\.blocks\.0\.pool\.0", "adaptive pooling"),
])
def test_non_local_networks_refused_before_any_work(arch, encoder, module, kind):
    net = SMPModel(arch, encoder, in_channels=4, num_classes=3)
    with pytest.raises(ConfigError) as err:
        net.footprint()
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"model.arch={arch} model.encoder={encoder}: ")
    assert __import__("re").search(module, msg) and kind in msg
    assert "tiling.exact=false" in msg and "model.encoder=resnet34" in msg


def test_a_network_that_needs_the_whole_image_even_skipped_says_its_fallback_halo(caplog):
    """PSPNet's pyramid pooling cannot be skipped (its output is not the input's shape): the
    approximate halo is two alignment steps, and the log says so rather than "local"."""
    net = SMPModel("PSPNet", "tu-test_resnet", in_channels=4, num_classes=3)
    with caplog.at_level("WARNING", logger="seg_at_scale.models.smp"):
        fp = net.approximate_footprint()
    assert (fp.halo, fp.align) == (2 * net.downsampling_factor, net.downsampling_factor)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "model.arch=PSPNet model.encoder=tu-test_resnet: the network needs the whole " \
        "image even with its non-local modules skipped" in said
    assert f"approximate halo is {fp.halo} px (two alignment steps, or more" in said


@pytest.mark.parametrize("arch", ["MAnet", "PAN"])
def test_networks_the_halo_probe_cannot_run_on_still_tile_approximately(arch, caplog):
    """MAnet (the probe overflows) and PAN (its pyramid attention needs 128 px) take
    ``tiling.exact=false``: the fallback halo, said in the log, and the smallest tile it
    makes (one core of one alignment step) runs through the network."""
    net = SMPModel(arch, "tu-test_resnet", in_channels=4, num_classes=3).eval()
    with caplog.at_level("WARNING", logger="seg_at_scale.models.smp"):
        fp = net.approximate_footprint()
    assert fp.halo >= 2 * fp.align and fp.halo % fp.align == 0
    assert "the halo probe fails on the network with its non-local modules skipped" in \
        caplog.text and f"so its approximate halo is {fp.halo} px" in caplog.text
    side = fp.align + 2 * fp.halo
    with torch.no_grad():
        assert net(torch.randn(2, 4, side, side)).shape == (2, 3, side, side)


def test_smp_size_dependent_upsampling_is_refused_unless_made_invariant():
    node = {"_target_": "seg_at_scale.models.SMPModel", "arch": "FPN",
            "encoder": "tu-test_resnet", "in_channels": 3, "num_classes": 2}
    with pytest.raises(ConfigError, match="align_corners=True"):
        build_model({**node, "align_corners": True}, where="t").footprint()
    assert build_model(node, where="t").footprint().align == 32


def test_the_probe_finds_a_whole_image_statistic_no_type_names():
    class Gate(torch.nn.Module):  # a functional squeeze-excitation: no module to recognise
        def forward(self, x):
            return x * torch.sigmoid(x.mean(dim=(2, 3), keepdim=True))

    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), Gate(),
                              torch.nn.Conv2d(2, 2, 3, padding=1))
    with pytest.raises(WholeImageDependency, match="depend on the whole input"):
        empirical_halo(net, align=1)


def test_unknown_architecture_encoder_and_options_refused():
    with pytest.raises(ConfigError, match="model.arch='Unett' is not an smp architecture"):
        SMPModel("Unett", "resnet18")
    with pytest.raises(ConfigError, match="model.encoder='resnet35' is not an smp encoder"):
        SMPModel("Unet", "resnet35")
    with pytest.raises(ConfigError, match=r"model.options has \['decoder_chanels'\]"):
        SMPModel("Unet", "resnet18", options={"decoder_chanels": [8] * 5})
    with pytest.raises(ConfigError, match=r"model.shape is not a model key: use one of .*arch"):
        build_model({"_target_": "seg_at_scale.models.SMPModel", "shape": 3}, where="t")


def test_squeeze_excitation_runs_with_overlap_and_blend_and_deviation_is_measured():
    torch.manual_seed(0)
    net = lively(SMPModel("Unet", "tu-test_efficientnet", in_channels=4, num_classes=3,
                          options={"decoder_channels": [16, 16, 8, 8, 8]}))
    fp = net.approximate_footprint()
    assert fp.align == 32 and fp.halo > 0
    x = torch.randn(1, 4, 203, 171)
    ref = net(torch.nn.functional.pad(x, (0, 21, 0, 21)))[..., :203, :171]
    approx = predict_blended(net, x, window=128, overlap=0.5)
    dev = label_deviation(approx, ref)
    assert approx.shape == ref.shape and torch.isfinite(approx).all()
    assert 0 < dev["labels_off_pct"] < 100  # approximate, and said so
    whole = predict_blended(net, x, window=256)  # one window: the whole-image forward
    assert torch.allclose(whole, ref, atol=1e-5 * float(ref.abs().max()))


def test_blending_a_local_network_deviates_from_the_whole_image_forward():
    net = preset_model("unet_test_resnet")
    x = torch.randn(1, 4, 301, 277)
    ref = predict_full(net, x)
    dev = label_deviation(predict_blended(net, x, window=128, overlap=0.25), ref)
    assert dev["labels_off_pct"] > 0.1 and dev["max_logit_gap"] > 1e-3


def test_windows_cover_the_extended_image_aligned():
    starts = window_starts(224, 96, 0.25, 32)
    assert starts == [0, 64, 128] and all(s % 32 == 0 for s in starts)
    assert window_starts(64, 128, 0.25, 32) == [0]


def test_a_run_with_tiling_exact_false_takes_the_approximate_footprint(caplog):
    from omegaconf import OmegaConf

    from seg_at_scale.cli.pretrained import run_footprint

    net = SMPModel("Unet", "tu-test_efficientnet", in_channels=4, num_classes=3,
                   options={"decoder_channels": [16, 16, 8, 8, 8]})
    with pytest.raises(ConfigError, match="squeeze-excitation"):
        run_footprint(net, OmegaConf.create({"exact": True, "halo": "auto"}))
    with caplog.at_level("WARNING"):
        fp = run_footprint(net, OmegaConf.create({"exact": False, "halo": "auto"}))
    assert fp == net.approximate_footprint() and fp.align == 32
    assert "do NOT reproduce the whole-image computation" in caplog.text


def test_an_input_smaller_than_the_network_takes_is_named_in_its_words():
    """Before: PAN on a 64 x 64 image (a multiple of its alignment) failed with torch's
    "Given input size: (1x1x1). Calculated output size: (1x0x0). Output size is too small"
    from a pooling layer deep inside; smp's own words for a size off the alignment stay."""
    net = SMPModel("PAN", "tu-test_resnet", in_channels=4, num_classes=3).eval()
    a = net.downsampling_factor
    with torch.no_grad(), pytest.raises(InputError) as err:
        net(torch.randn(1, 4, 2 * a, 3 * a))
    assert str(err.value) == (
        f"model.arch=PAN: the network takes inputs of at least 128 x 128 pixels, and this one "
        f"is {2 * a} x {3 * a}; give a larger image (or pad it), or larger tiles")
    with torch.no_grad(), pytest.raises(RuntimeError, match="divisible by"):
        net(torch.randn(1, 4, 2 * a + 1, 3 * a))
    with torch.no_grad():
        assert net(torch.randn(1, 4, 128, 128 + a)).shape == (1, 3, 128, 128 + a)
