"""The model contract: every family the registry builds satisfies it, a family that breaks
it is refused when built (naming the member), and a capability a model lacks is refused in
one line naming it."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.memory.modes import MemoryConfig, apply_memory_mode
from seg_at_scale.models import registry
from seg_at_scale.models.contract import (
    DualOutput,
    FineTunable,
    Pipelined,
    SegmentationNetwork,
    Staged,
    check_contract,
    require,
)
from seg_at_scale.models.gscnn import GSCNN
from seg_at_scale.models.registry import Family, build_model
from seg_at_scale.models.smp import SMPModel
from seg_at_scale.prediction import PredictOptions
from seg_at_scale.prediction.staged_raster import check_staged
from seg_at_scale.tiling import Footprint

NODES = {
    "unet": {"_target_": "seg_at_scale.models.UNet", "in_channels": 3, "num_classes": 4,
             "levels": 3, "base_width": 4},
    "uresnet": {"_target_": "seg_at_scale.models.UResNet", "planes": 3, "num_classes": 3,
                "depth": 3, "initial_filters": 4},
    "smp": {"_target_": "seg_at_scale.models.smp.SMPModel", "arch": "Unet",
            "encoder": "tu-test_resnet", "in_channels": 3, "num_classes": 4},
}


@pytest.mark.parametrize("family", sorted(NODES))
def test_every_family_built_by_the_registry_satisfies_the_contract(family):
    net = build_model(NODES[family], where="test")
    assert isinstance(net, SegmentationNetwork)
    assert (net.in_channels, net.num_classes) == (3, NODES[family]["num_classes"])
    fp = net.footprint()
    assert fp.align == net.downsampling_factor and fp.halo > 0


class NoFootprint(nn.Module):
    def __init__(self, in_channels: int = 3, num_classes: int = 2) -> None:
        super().__init__()
        self.in_channels, self.num_classes = in_channels, num_classes
        self.conv = nn.Conv2d(in_channels, num_classes, 3, padding=1)

    downsampling_factor = 1

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class NoClasses(NoFootprint):
    def footprint(self) -> Footprint:
        return Footprint(1, 1, "same", 0)


@pytest.mark.parametrize("cls, node, match", [
    (NoFootprint, {}, r"NoFootprint breaks the model contract: it has no footprint\(\)"),
    (NoClasses, {"num_classes": 0}, r"NoClasses breaks the model contract: num_classes=0"),
])
def test_a_family_that_breaks_the_contract_is_refused_when_built(monkeypatch, cls, node, match):
    target = f"{__name__}.{cls.__name__}"
    monkeypatch.setitem(registry._FAMILIES, "broken", Family("broken", target, cls))
    with pytest.raises(ConfigError, match=match):
        build_model({"_target_": target, **node}, where="test")


def test_a_missing_capability_is_refused_in_one_line_naming_it():
    torch.manual_seed(0)
    net = SMPModel("Unet", "tu-test_resnet", 3, 4)
    assert not isinstance(net, Pipelined) and isinstance(net, FineTunable)
    with pytest.raises(ConfigError, match=r"^pipeline=manual needs pipelines and strip "
                                          r"checkpointing \(pipeline_layers\), which SMPModel "
                                          r"does not have$"):
        require(net, Pipelined, "pipeline=manual")
    with pytest.raises(ConfigError, match=r"granularity=strips: SMPModel has no flat layer form"):
        apply_memory_mode(net, MemoryConfig(mode="checkpoint", granularity="strips"))
    assert check_contract(net) is net


def test_a_child_named_like_a_capability_is_not_that_capability():
    """Gated-SCNN keeps its backbone's stages in a child ``stages`` list: ``isinstance``
    through ``__getattr__`` (Python <= 3.11) took it for the ``Staged`` capability, and
    ``staged=true`` then failed calling the list. The refusal is one line on every Python."""
    net = GSCNN(in_channels=3, num_classes=4, stem_width=4, widths=(4, 4, 8, 8),
                shape_widths=(4, 4, 4), aspp_width=4, decoder_width=4)
    assert isinstance(net.stages, nn.ModuleList) and not isinstance(net, Staged)
    assert isinstance(net, SegmentationNetwork) and isinstance(net, DualOutput)
    with pytest.raises(ConfigError, match=r"^staged=true needs stage-by-stage prediction "
                                          r"\(stages; smp networks\), which GSCNN does not have"):
        check_staged(net, PredictOptions(), world=1)
