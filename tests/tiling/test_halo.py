import pytest
import torch

from seg_at_scale.models import UNet
from seg_at_scale.tiling import empirical_halo, halo_width


@pytest.mark.parametrize("levels,n_c", [(5, 2), (4, 2), (3, 2), (4, 3), (2, 1), (1, 2)])
def test_valid_unet_halo_formula_and_shrink(levels, n_c):
    net = UNet(in_channels=1, num_classes=2, levels=levels, convs_per_level=n_c, base_width=2,
               padding="valid")
    formula = (3 * 2 ** (levels - 2) - 1) * 2 * n_c if levels >= 2 else n_c
    assert halo_width(net) == formula
    size = net.valid_input_size(3 * formula)
    out = net(torch.zeros(1, 1, size, size)).shape[-1]
    assert size - out == 2 * formula  # the halo is exactly the per-side shrink
    assert empirical_halo(net) == formula


def test_2015_unet_maps_572_to_388_with_halo_92():
    net = UNet(in_channels=1, num_classes=2, levels=5, convs_per_level=2, base_width=1,
               padding="valid")
    assert net(torch.zeros(1, 1, 572, 572)).shape[-2:] == (388, 388)
    assert halo_width(net) == 92
    fp = net.footprint()
    assert (fp.align, fp.out_residue, net.valid_input_size(570)) == (16, 4, 572)


@pytest.mark.parametrize("upsample", ["transpose", "nearest", "bilinear"])
@pytest.mark.parametrize("levels,n_c", [(5, 2), (3, 2), (4, 1)])
def test_same_padding_analytic_halo_equals_measured(levels, n_c, upsample):
    net = UNet(in_channels=2, num_classes=3, levels=levels, convs_per_level=n_c, base_width=2,
               padding="same", upsample=upsample)
    assert halo_width(net, "analytic") == empirical_halo(net) == halo_width(net, "empirical")


def test_generic_model_without_footprint_is_measured():
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 5, padding=2), torch.nn.ReLU(),
                              torch.nn.Conv2d(2, 2, 3, padding=1))
    assert halo_width(net) == 3


def test_bilinear_valid_is_refused():
    with pytest.raises(ValueError, match="upsample='bilinear'"):
        UNet(padding="valid", upsample="bilinear")


def test_halo_probe_works_under_no_grad():
    """The probe back-propagates: a model whose footprint is first asked for inside
    ``torch.no_grad()`` (predict_full, a validation loop) must still get it."""
    net = UNet(in_channels=2, num_classes=3, levels=3, base_width=4, padding="same")
    expected = empirical_halo(net)
    with torch.no_grad():
        assert empirical_halo(net) == expected
