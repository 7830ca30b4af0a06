"""An smp network as stages for :func:`seg_at_scale.tiling.staged.predict_staged`.

The encoder is a chain: each stage turns the previous feature map into the next one
(smp's ResNet family: stem, pool + ``layer1``, ``layer2`` ... ; a timm ``tu-`` encoder:
the modules of its feature net between two returned features). The decoder with the
segmentation head is the last stage; it reads every feature map, as smp's forward hands
them to it (the input image first; a transformer-style encoder's empty stride-2 map).
DeepLabV3+'s decoder is two: ASPP on the deepest map, then the fusion with the stride-4
map and the head.

>>> from seg_at_scale.models.smp import SMPModel
>>> net = SMPModel("Unet", "tu-test_resnet", in_channels=4, num_classes=3,
...                options={"decoder_channels": [16, 16, 8, 8, 8]}).eval()
>>> [s.name for s in smp_stages(net)]
['encoder.conv1..act1', 'encoder.maxpool..layer1', 'encoder.layer2', 'encoder.layer3', \
'encoder.layer4', 'decoder+head']
"""

from __future__ import annotations

import torch
from segmentation_models_pytorch.decoders.deeplabv3.decoder import DeepLabV3PlusDecoder
from segmentation_models_pytorch.encoders.resnet import ResNetEncoder
from segmentation_models_pytorch.encoders.timm_universal import TimmUniversalEncoder
from timm.models._features import FeatureListNet
from torch import Tensor, nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.models.smp_exact import non_local_modules, refusal
from seg_at_scale.tiling.staged import Chain, Stage

__all__ = ["smp_stages"]


class _Decode(nn.Module):
    """The last stage: smp's decoder on the feature list, then the segmentation head."""

    def __init__(self, decoder: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.decoder, self.head = decoder, head

    def forward(self, xs: list[Tensor]) -> Tensor:
        return self.head(self.decoder(list(xs)))  # type: ignore[no-any-return]


class _FusePlus(nn.Module):
    """DeepLabV3+'s decoder after ASPP (smp's forward from ``self.up`` on), then the head."""

    def __init__(self, decoder: DeepLabV3PlusDecoder, head: nn.Module) -> None:
        super().__init__()
        self.decoder, self.head = decoder, head

    def forward(self, xs: list[Tensor]) -> Tensor:
        aspp, high_res = xs
        d = self.decoder
        fused = d.block2(torch.cat([d.up(aspp), d.block1(high_res)], dim=1))
        return self.head(fused)  # type: ignore[no-any-return]


class _Empty(nn.Module):
    """A transformer-style encoder's stride-2 feature: no channels (smp's placeholder)."""

    def forward(self, xs: list[Tensor]) -> Tensor:
        (x,) = xs
        return x.new_empty(x.shape[0], 0, x.shape[-2] // 2, x.shape[-1] // 2)


def smp_stages(model: nn.Module) -> list[Stage]:
    """The stages of an smp network (or an :class:`~seg_at_scale.models.smp.SMPModel`).

    Raises:
        ConfigError: the encoder is neither smp's ResNet family nor a timm feature list
            (naming it and the fix), the model has a classification head, or an operation
            needs the whole input (squeeze-excitation, attention: the exact-tiling refusal).
    """
    net = getattr(model, "net", model)
    if getattr(net, "classification_head", None) is not None:
        raise ConfigError("tiling.staged: the model has a classification head (aux_params); "
                          "staged tiling predicts masks only: use tiling.staged=false")
    prefix = "net." if net is not model else ""  # as SMPModel.non_local names them
    found = [(prefix + n, k) for n, k in non_local_modules(net)]
    if found:  # a stage would see only its tile's statistics, as a whole-network tile would
        raise ConfigError(refusal("tiling.staged", found))
    chain = _encoder_chain(net.encoder)
    stages: list[Stage] = []
    for name, module, stride in chain:
        src = 0 if not stages or name == "empty" else _last_real(stages)
        stages.append(Stage(f"encoder.{name}", module, (src,), stride))
    depth = len(stages)
    if isinstance(net.decoder, DeepLabV3PlusDecoder):
        # ASPP reads only the deepest map, whose stage is one tile where the whole decoder
        # would take its 600-pixel halo at the stride-4 map's tile size
        stages.append(Stage("decoder.aspp", Chain(net.decoder.aspp), (depth,),
                            stages[-1].stride))
        stages.append(Stage("decoder.fuse+head", _FusePlus(net.decoder, net.segmentation_head),
                            (depth + 1, 2), 1))
    else:
        stages.append(Stage("decoder+head", _Decode(net.decoder, net.segmentation_head),
                            tuple(range(depth + 1)), 1))
    for st in stages:  # the wrappers take the network's mode (they hold its modules)
        st.module.train(net.training)
    return stages


def _last_real(stages: list[Stage]) -> int:
    """Map index of the last stage output that is a real feature (not the empty one)."""
    for k in range(len(stages) - 1, -1, -1):
        if not isinstance(stages[k].module, _Empty):
            return k + 1
    return 0


def _encoder_chain(enc: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """``(name, stage module, output stride)`` for each feature the encoder returns."""
    if isinstance(enc, ResNetEncoder):
        parts = [("conv1+bn1+relu", [enc.conv1, enc.bn1, enc.relu]),
                 ("maxpool+layer1", [enc.maxpool, enc.layer1]),
                 ("layer2", [enc.layer2]), ("layer3", [enc.layer3]), ("layer4", [enc.layer4])]
        return _with_strides(enc, [(n, Chain(*m)) for n, m in parts[: enc._depth]])
    if isinstance(enc, TimmUniversalEncoder) and isinstance(enc.model, FeatureListNet) and \
            not enc._is_channel_last and not enc._is_vgg_style:
        found: list[tuple[str, nn.Module]] = []
        run: list[tuple[str, nn.Module]] = []
        for name, m in enc.model.items():
            run.append((name, m))
            if name in enc.model.return_layers:
                label = run[0][0] if len(run) == 1 else f"{run[0][0]}..{run[-1][0]}"
                found.append((label, Chain(*[mod for _, mod in run])))
                run = []
        if enc._is_transformer_style:
            found.insert(0, ("empty", _Empty()))
        return _with_strides(enc, found)
    raise ConfigError(f"tiling.staged: the encoder {type(enc).__name__} is not one whose "
                      "stages are known (smp's ResNet family, or a timm tu- encoder with a "
                      "feature list); use tiling.staged=false")


@torch.no_grad()
def _with_strides(enc: nn.Module, parts: list[tuple[str, nn.Module]]
                  ) -> list[tuple[str, nn.Module, int]]:
    """Each part's output stride, from one small forward of the chain."""
    size = 2 * int(getattr(enc, "output_stride", 32))
    channels = _in_channels(enc)
    x = torch.zeros(1, channels, size, size)
    out, last = [], x
    for name, m in parts:
        y = m([x if isinstance(m, _Empty) else last])
        if not isinstance(m, _Empty):
            last = y
        out.append((name, m, size // y.shape[-1]))
    return out


def _in_channels(enc: nn.Module) -> int:
    for m in enc.modules():
        if isinstance(m, nn.Conv2d):
            return int(m.in_channels)
    raise ConfigError(f"tiling.staged: no convolution in the encoder {type(enc).__name__}")
