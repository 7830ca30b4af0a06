"""``tiling.infer``, the one entry for predicting a tensor tiled: it picks the exact method
the network allows, equals the untiled forward at sizes that are not multiples of the
alignment, and refuses in one line what a network cannot do exactly."""

from __future__ import annotations

import pytest
import torch
from helpers.smp import assert_exact

from seg_at_scale.errors import ConfigError
from seg_at_scale.models import UNet
from seg_at_scale.models.gscnn import GSCNN
from seg_at_scale.models.smp import SMPModel
from seg_at_scale.tiling import footprint, infer, predict_full, predict_tiled
from seg_at_scale.tiling.geometry import Footprint
from seg_at_scale.tiling.infer import choose_method

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def unet(**kw) -> UNet:
    torch.manual_seed(0)
    return UNet(in_channels=4, num_classes=3, levels=3, base_width=4, **kw).eval()


@pytest.mark.parametrize("padding", ["same", "valid"])
@pytest.mark.parametrize("tiling", [{"q": 2}, {"q": (3, 2)}, {"tile_size": 64}])
def test_auto_tiles_equal_the_untiled_forward_at_odd_sizes(padding, tiling):
    net = unet(padding=padding)
    x = torch.randn(1, 4, 101, 87)
    ref = predict_full(net, x)
    assert torch.equal(infer(net, x), ref)  # no grid: the untiled forward itself
    assert (infer(net, x, **tiling) - ref).abs().max() < 1e-5
    assert infer(net, x[0], **tiling).shape == ref.shape[1:]  # unbatched in, unbatched out


def test_statistic_sites_take_the_passes_and_plain_tiles_are_refused():
    torch.manual_seed(0)
    net = SMPModel("FPN", "tu-test_resnet", 4, 5, options={
        "decoder_pyramid_channels": 32, "decoder_segmentation_channels": 32}).eval()
    assert choose_method(net, tiled=True) == "passes"
    x = torch.randn(1, 4, 197, 229)
    ref = predict_full(net, x)
    assert (infer(net, x, q=2) - ref).abs().max() < 1e-4
    with pytest.raises(ConfigError, match=r"GroupNormSite.*predict_tiled_exact"):
        infer(net, x, q=2, method="tiled")


def test_two_pass_pooling_is_chosen_for_gated_scnn_and_plain_tiles_refused():
    torch.manual_seed(0)
    net = GSCNN.from_preset("tiny", in_channels=4, num_classes=3).eval()
    with torch.no_grad():
        net.aspp.pool.conv.weight.mul_(30)  # make the pooled branch matter
    assert choose_method(net, tiled=True) == "two_pass"
    x = torch.randn(1, 4, 301, 277)
    ref = predict_full(net, x)
    assert (infer(net, x, q=2) - ref).abs().max() < 1e-4
    with pytest.raises(ConfigError, match=r"pools over its whole input.*two_pass"):
        infer(net, x, q=2, method="tiled")


def plain_group_norm() -> torch.nn.Module:
    """A network with a GroupNorm the project has not made a statistic site."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.GroupNorm(2, 8),
                               torch.nn.Conv2d(8, 3, 1)).eval()


@pytest.mark.parametrize("make", [
    plain_group_norm,
    lambda: torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.InstanceNorm2d(8),
                                torch.nn.Conv2d(8, 3, 1)).eval(),
])
def test_layers_that_see_the_whole_input_are_refused_tiled_and_run_untiled_as_they_are(make):
    """Before: untiled, the footprint probe of a network that has none failed with a
    WholeImageDependency traceback, though the refusal said "predict it untiled"."""
    net = make()
    x = torch.randn(1, 4, 61, 53)
    with pytest.raises(ConfigError, match=r"Norm2?d?\) computes over the whole input.*untiled"):
        infer(net, x, q=2)
    assert torch.equal(infer(net, x), net(x))


def test_a_training_batch_norm_is_refused_by_every_entry_and_left_unchanged(tmp_path):
    """Before: only infer's tiled methods refused it; predict_tiled, predict_raster and
    untiled infer ran with each tile's statistics (logits 2.4 off) and moved the running
    statistics."""
    from seg_at_scale.io import write_raster
    from seg_at_scale.prediction import predict_raster

    net = unet(norm="batch").train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(1, 4, 61, 53)
    image = write_raster(tmp_path / "x.tif", (torch.rand(4, 61, 53) * 255).byte().numpy())
    calls = [("infer", lambda: infer(net, x)), ("infer", lambda: infer(net, x, q=2)),
             ("predict_tiled", lambda: predict_tiled(net, x, q=2)),
             ("predict_raster", lambda: predict_raster(net, image, tmp_path / "o.tif"))]
    for who, call in calls:
        with pytest.raises(ConfigError, match=rf"^{who}: down\.0\.1 \(BatchNorm2d\) is in "
                           r"training mode.*call model.eval\(\) first$"):
            call()
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.tif"]  # nothing written


def test_a_network_that_pools_without_saying_so_is_tiled_on_its_measured_grid():
    """Before: a network without ``downsampling_factor`` was tiled with alignment 1, so
    tiles cut its max-pool windows elsewhere than the image does (logits 1.08 off). The
    logits are compared to fp32 summation noise: MKL's sgemm on AVX2 sums a pixel's 72
    products in an order that depends on the tile's width (1e-8 apart on an AMD EPYC)."""

    class Pooled(torch.nn.Module):
        def __init__(self, stride_conv: bool) -> None:
            super().__init__()
            self.a = torch.nn.Conv2d(4, 8, 3, padding=1, stride=2 if stride_conv else 1)
            self.pool = torch.nn.MaxPool2d(2)
            self.b = torch.nn.Conv2d(8, 3, 3, padding=1)
            self.up = 4 if stride_conv else 2

        def forward(self, x):
            y = self.b(self.pool(torch.relu(self.a(x))))
            return torch.nn.functional.interpolate(y, scale_factor=self.up, mode="bilinear")

    torch.manual_seed(0)
    x = torch.randn(1, 4, 61, 47)
    for stride_conv, align in ((False, 2), (True, 4)):
        net = Pooled(stride_conv).eval()
        assert footprint(net).align == align
        ref = infer(net, x)
        for q in (2, 3, (3, 2)):
            assert_exact(infer(net, x, q=q), ref, tol=1e-6)


def test_a_network_that_no_shift_moves_is_refused_tiled():
    class Corners(torch.nn.Module):  # align_corners=True: its grid depends on the image size
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Conv2d(4, 3, 3, padding=1, stride=2)

        def forward(self, x):
            return torch.nn.functional.interpolate(self.a(x), size=x.shape[-2:],
                                                   mode="bilinear", align_corners=True)

    net = Corners().eval()
    with pytest.raises(ConfigError, match=r"^Corners's output does not move with its input by "
                       r"any shift up to 64 pixels .*no tiling of it is exact"):
        infer(net, torch.randn(1, 4, 61, 47), q=2)


@pytest.mark.parametrize("image, kw, said", [
    (torch.randn(1, 4, 61, 53).to(torch.uint8), {}, r"the image is torch.uint8; give it "
     r"normalised"),
    (torch.randn(1, 4, 61, 53).half(), {}, r"the image is torch.float16 and the network "
     r"torch.float32"),
    (torch.randn(1, 3, 61, 53), {}, r"the image has 3 channels and the network takes 4"),
    (torch.randn(1, 1, 4, 61, 53), {}, r"the image is \[1, 1, 4, 61, 53\]; give \[B, C, H, W\]"),
    (torch.randn(1, 4, 61, 53), {"q": 0}, r"q=0: give at least 1 tile per side"),
    (torch.randn(1, 4, 61, 53), {"q": 2.5}, r"q=2.5: give a whole number of tiles per side"),
    (torch.randn(1, 4, 61, 53), {"tile_size": "512"}, r"tile_size='512': give a whole number "
     r"of pixels"),
])
def test_what_the_network_cannot_take_is_refused_in_one_line(image, kw, said):
    """Before: torch's words from inside a tile's forward, or "use a smaller q" for q=0."""
    with pytest.raises(ConfigError, match=said):
        infer(unet(), image, q=kw.get("q", 2) if "tile_size" not in kw else None, **{
            k: v for k, v in kw.items() if k != "q"})


@pytest.mark.parametrize("q", [2, 3])
def test_a_group_norm_unet_is_tiled_exactly_by_statistic_passes(q):
    """Its GroupNorms are statistic sites: tiled, each sees the whole image's statistics."""
    net = unet(norm="group", padding="same")
    x = torch.randn(1, 4, 203, 171)
    assert choose_method(net, tiled=True) == "passes"
    ref = predict_full(net, x)
    tiled = infer(net, x, q=q)
    assert (tiled - ref).abs().max() < 1e-5 and torch.equal(tiled.argmax(1), ref.argmax(1))
    with pytest.raises(ConfigError, match=r"model.norm='group' with model.padding='valid'"):
        unet(norm="group", padding="valid")


def test_bad_methods_and_options_are_refused_in_one_line():
    net, x = unet(), torch.randn(1, 4, 61, 53)
    with pytest.raises(ConfigError, match=r"method='sliding' is not one of auto, untiled"):
        infer(net, x, method=str("sliding"))  # noqa: UP018 (not a Method literal, on purpose)
    with pytest.raises(ConfigError, match=r"method='tiled' tiles the image: give q or tile_size"):
        infer(net, x, method="tiled")
    with pytest.raises(ConfigError, match=r"'blended' takes one int tile_size"):
        infer(net, x, method="blended", q=2)
    with pytest.raises(ConfigError, match=r"'blended' needs a same-padding network"):
        infer(unet(padding="valid"), x, method="blended", tile_size=32)


def test_a_footprint_that_would_not_tile_the_network_exactly_is_refused(tmp_path):
    """Before: ``fp=`` was taken at its word: a halo of 4 for this U-Net's 22 gave tiled
    logits 2e-4 off the untiled forward, silently; alignment 1 failed with torch's shape
    error from inside the tile loop."""
    from seg_at_scale.io import write_raster
    from seg_at_scale.prediction import PredictOptions, predict_raster

    net = unet(padding="same")
    need = net.footprint()
    x = torch.randn(1, 4, 61, 53)
    image = write_raster(tmp_path / "x.tif", (torch.rand(4, 61, 53) * 255).byte().numpy())
    small = Footprint(need.align, need.align, "same", 0)
    off_grid = Footprint(need.halo, 1, "same", 0)
    calls = [("infer", lambda fp: infer(net, x, q=2, fp=fp)),
             ("predict_raster", lambda fp: predict_raster(
                 net, image, tmp_path / "o.tif", PredictOptions(tile_size=32, progress=False),
                 fp=fp))]
    for who, call in calls:
        for fp in (small, off_grid):
            with pytest.raises(ConfigError, match=rf"^{who}: fp=Footprint\(halo={fp.halo}, "
                               rf"align={fp.align}.* does not tile UNet exactly .*leave fp out.*"
                               rf"give halo >= {need.halo}, align a multiple of {need.align}"):
                call(fp)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.tif"]  # nothing written
    wider = Footprint(need.halo + need.align, 2 * need.align, "same", 0)
    assert torch.equal(infer(net, x, q=2, fp=wider), infer(net, x))  # more context: exact


def test_blended_is_only_run_when_named_and_is_not_exact():
    net = plain_group_norm()  # a network tiles cannot compute exactly
    x = torch.randn(1, 4, 96, 96)
    fp = Footprint(1, 1, "same", 0)  # its convolutions'
    ref = predict_full(net, x, fp)
    approx = infer(net, x, method="blended", tile_size=48, overlap=0.5, fp=fp)
    assert approx.shape == ref.shape
    assert (approx - ref).abs().max() > 1e-4  # an approximation, as its name says


def test_a_group_norm_unet_in_channels_last_gives_one_grids_labels_at_every_q():
    """Before: one tile (the whole image) ran torch's channels-last GroupNorm, 3.5e-5 from the
    statistic the passes give the tiles: 15 labels of a 517 x 743 scene changed with q."""
    net = unet(norm="group", padding="same")
    head = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)][-1]
    with torch.no_grad():
        head.weight.mul_(30)  # a trained network's confident logits
    net = net.to(memory_format=torch.channels_last)
    x = torch.randn(1, 4, 203, 171)
    whole = infer(net, x, channels_last=True)
    bound = 1e-5 * float(whole.abs().max())  # float rounding of logits up to ~25
    for q in (1, 2, 3):
        tiled = infer(net, x, q=q, channels_last=True)
        assert (tiled - whole).abs().max() < bound
        assert torch.equal(tiled.argmax(1), whole.argmax(1))
    contiguous = infer(net.to(memory_format=torch.contiguous_format), x)
    assert (whole - contiguous).abs().max() < bound
