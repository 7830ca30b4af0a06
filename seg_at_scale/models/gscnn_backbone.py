"""Gated-SCNN's regular stream from a pretrained timm backbone, as in the paper.

The paper's regular stream is an ImageNet ResNet-101 or WideResNet-38 at output stride 8.
:class:`TimmBackbone` builds any timm network with that feature layout
(``features_only``, ``output_stride=8``: stem at 1/2, then 1/4, 1/8 and two dilated
stages at 1/8, e.g. ``resnet50``, ``resnet101``, ``wide_resnet50_2``) and loads its
weights from a file through :func:`seg_at_scale.models.weights.load_weights` (timm /
torchvision / torchgeo layouts, ``band_map`` for the input bands). Its BatchNorms keep
their pretrained statistics in eval mode; tiled training stays exact with them frozen
(``finetune.freeze_bn``).

>>> net = TimmBackbone("test_resnet", in_channels=3)
>>> [tuple(f.shape[1:]) for f in net(torch.zeros(1, 3, 64, 64))][:3], net.channels[0]
([(32, 32, 32), (32, 16, 16), (48, 8, 8)], 32)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch  # noqa: F401 (the doctest)
from torch import Tensor, nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.models.weights import band_normalization, load_weights

if TYPE_CHECKING:
    from timm.models import FeatureInfo

__all__ = ["TimmBackbone", "LAYOUT", "regular_stream"]

LAYOUT = [2, 4, 8, 8, 8]  # reductions of the five features Gated-SCNN's streams take


class TimmBackbone(nn.Module):
    """A timm network's five features ``[1/2, 1/4, 1/8, 1/8, 1/8]`` (output stride 8).

    Args:
        name: timm model name (``resnet101``, ``wide_resnet50_2``, ...).
        in_channels: input bands it reads.
        weights: a weights file for it (or a hub name, online only).
        band_map: pretrained input channel per band (null: starts at zero).
    """

    def __init__(self, name: str, in_channels: int, weights: str | None = None,
                 band_map: Sequence[int | None] | None = None) -> None:
        super().__init__()
        import timm

        try:
            self.body = timm.create_model(name, features_only=True, output_stride=8,
                                          out_indices=(0, 1, 2, 3, 4), in_chans=in_channels,
                                          pretrained=False)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ConfigError(f"model.backbone={name!r}: timm cannot build it at output "
                              f"stride 8 ({exc}); use a ResNet-like timm model (resnet50, "
                              "resnet101, wide_resnet50_2)") from None
        info = cast("FeatureInfo", self.body.feature_info)  # features_only=True
        got = list(info.reduction())
        if got != LAYOUT:
            raise ConfigError(f"model.backbone={name!r} gives features at 1/{got}, not "
                              f"1/{LAYOUT}; use a ResNet-like timm model (resnet50, resnet101, "
                              "wide_resnet50_2)")
        self.name = name
        self.channels: list[int] = list(info.channels())
        self.report = ""
        #: the weights' normalisation per band it reads (None: the weights record none)
        self.normalization: dict[str, Any] | None = None
        if weights is not None:
            loaded = load_weights(self.body, weights, key="model.backbone_weights",
                                  encoder=f"tu-{name}", in_channels=in_channels,
                                  band_map=band_map, named=f"backbone {name}")
            self.report = loaded.report
            if loaded.normalization is not None:
                self.normalization = band_normalization(
                    loaded.normalization, None if band_map is None else list(band_map),
                    loaded.file_channels, in_channels)
        elif band_map is not None:
            raise ConfigError(f"model.band_map={list(band_map)} maps pretrained channels, but "
                              "no weights are given; set model.backbone_weights")

    def forward(self, x: Tensor) -> list[Tensor]:
        """``[stem (1/2), stage1 (1/4), stage2 (1/8), stage3, stage4]`` for ``[B, C, H, W]``."""
        return list(self.body(x))



def regular_stream(backbone: str | None, in_channels: int, weights: str | None,
                   band_map: Sequence[int | None] | None) -> TimmBackbone | None:
    """Gated-SCNN's ``model.backbone``: a :class:`TimmBackbone`, or None (the built-in one)."""
    if backbone is None:
        if weights is not None or band_map is not None:
            raise ConfigError("model.backbone_weights / model.band_map need model.backbone "
                              "(a timm network, e.g. resnet101)")
        return None
    return TimmBackbone(backbone, in_channels, weights, band_map)
