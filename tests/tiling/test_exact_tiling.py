"""The project's central property: tiles reproduce the whole-image computation."""

import pytest
import torch
import torch.nn.functional as F

from seg_at_scale.models import UNet
from seg_at_scale.tasks.losses import CrossEntropy
from seg_at_scale.tiling import extend, predict_full, predict_tiled, tiled_backward


def lively(net: torch.nn.Module) -> torch.nn.Module:
    """Variance-keeping random weights: PyTorch's default init makes an untrained U-Net
    predict one class everywhere, which would let a label comparison pass trivially."""
    for m in net.modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.ConvTranspose2d)):
            torch.nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            torch.nn.init.uniform_(m.bias, -0.5, 0.5)
    return net.eval()


def assert_labels_equal(tiled: torch.Tensor, ref: torch.Tensor) -> None:
    """Labels agree wherever the reference is not a tie within float noise (~1e-7)."""
    labels = ref.argmax(1)
    assert labels.unique().numel() > 1  # a non-trivial labelling
    top2 = ref.topk(2, dim=1).values
    decided = (top2[:, 0] - top2[:, 1]) > 1e-5 * ref.abs().max()
    assert decided.float().mean() > 0.999
    assert torch.equal(tiled.argmax(1)[decided], labels[decided])


@pytest.mark.parametrize("q", [1, 2, 3, 5])
def test_valid_unet_tiled_equals_untiled_on_611x733(q):
    torch.manual_seed(0)
    net = lively(UNet(in_channels=3, num_classes=4, levels=4, convs_per_level=2, base_width=4,
                      padding="valid"))
    x = torch.randn(1, 3, 611, 733)
    ref, tiled = predict_full(net, x), predict_tiled(net, x, q=q)
    assert tiled.shape == (1, 4, 611, 733)
    assert (tiled - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert_labels_equal(tiled, ref)


@pytest.mark.parametrize("q", [2, 3, (2, 5)])
@pytest.mark.parametrize("upsample", ["transpose", "bilinear"])
def test_same_unet_tiled_equals_untiled(q, upsample):
    # sides are multiples of the downsampling factor (8) but not of the tile
    torch.manual_seed(1)
    net = lively(UNet(in_channels=4, num_classes=5, levels=4, convs_per_level=2, base_width=4,
                      padding="same", upsample=upsample))
    x = torch.randn(2, 4, 184, 232)
    ref, tiled = predict_full(net, x), predict_tiled(net, x, q=q)
    assert (tiled - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert_labels_equal(tiled, ref)


def test_same_unet_on_sides_not_multiple_of_alignment():
    torch.manual_seed(2)
    net = lively(UNet(in_channels=1, num_classes=2, levels=3, base_width=4, padding="same"))
    x = torch.randn(1, 1, 131, 97)
    with torch.no_grad():
        ref = net(F.pad(x, (0, 3, 0, 1)))[..., :131, :97]  # zero-extended to multiples of 4
    tiled = predict_tiled(net, x, tile_size=70)
    assert (tiled - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert_labels_equal(tiled, ref)


def test_two_tiles_reading_context_on_their_inner_side_only_are_exact():
    """An image up to 2 (tile - context) long takes two tiles per side, each reading its
    context on the inner side only (same padding: nothing past the edge)."""
    from seg_at_scale.tiling import footprint, make_grid

    torch.manual_seed(3)
    net = lively(UNet(in_channels=2, num_classes=3, levels=3, base_width=8, padding="same"))
    fp = footprint(net)
    x = torch.randn(1, 2, 2 * (160 - fp.context) - 13, 2 * (160 - fp.context) - 29)
    tile = 160
    grid = make_grid(x.shape[-2], x.shape[-1], fp, tile_size=tile)
    assert grid.shape == (2, 2) and max(t.read.height for t in grid) <= tile
    assert_labels_equal(predict_tiled(net, x, tile_size=tile), predict_full(net, x))


def test_tile_size_and_bf16_fast_path_agree_with_reference():
    torch.manual_seed(3)
    net = lively(UNet(in_channels=2, num_classes=3, levels=3, base_width=8, padding="same"))
    x = torch.randn(1, 2, 212, 156)
    ref = predict_full(net, x)
    tiled = predict_tiled(net, x, tile_size=96)
    assert (tiled - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert_labels_equal(tiled, ref)
    fast = predict_tiled(net, x, tile_size=96, autocast=torch.bfloat16)
    agree = (fast.argmax(1) == ref.argmax(1)).float().mean()
    assert agree >= 0.99  # bf16 is an approximation; labels agree almost everywhere


@pytest.mark.parametrize("padding,shape", [("valid", (301, 277)), ("same", (152, 120))])
@pytest.mark.parametrize("q", [2, 3])
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_summed_tile_gradients_equal_whole_image_gradient(padding, shape, q, dtype, rtol):
    # float64 shows the identity is exact (1e-5 asked, ~1e-15 seen); float32 shows that
    # summing ~80k pixel losses in another order only adds rounding noise
    torch.manual_seed(4)
    h, w = shape
    net = UNet(in_channels=3, num_classes=4, levels=3, convs_per_level=2, base_width=4,
               padding=padding).to(dtype)
    x = torch.randn(1, 3, h, w, dtype=dtype)
    target = torch.randint(0, 4, (1, h, w))
    target[0, :17, :23] = 255  # ignored pixels
    weights = [1.0, 2.0, 0.5, 1.5]
    loss = CrossEntropy(4, weights, ignore_index=255)
    fp = net.footprint()

    net.zero_grad()
    logits = net(extend(x, fp))[..., :h, :w]
    whole = F.cross_entropy(logits, target, weight=torch.tensor(weights, dtype=dtype),
                            ignore_index=255)
    whole.backward()
    reference = [p.grad.clone() for p in net.parameters()]

    net.zero_grad()
    tiled_loss = tiled_backward(net, x, target, loss, q=q)
    assert torch.allclose(tiled_loss.double(), whole.detach().double(), rtol=1e-5)
    for p, g in zip(net.parameters(), reference):  # relative error per parameter tensor
        assert (p.grad - g).norm() <= rtol * g.norm()
