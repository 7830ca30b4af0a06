"""An smp network as stages for :func:`seg_at_scale.tiling.staged.stages.predict_staged`.

The encoder is a chain: each stage turns the previous feature map into the next one
(smp's ResNet family: stem, pool + ``layer1``, ``layer2`` ... ; a timm ``tu-`` encoder:
the modules of its feature net between two returned features); the stem runs inside the
next stage where nothing else reads its stride-2 map (FPN, DeepLab). The decoder with the
segmentation head is the last stage; it reads every feature map, as smp's forward hands
them to it (the input image first; a transformer-style encoder's empty stride-2 map).
DeepLab's ASPP is a stage per reach: its 1 x 1 branch with the image pooling, then each
dilated branch alone (so a rate-12 branch's tiles read 12 map pixels past their core,
not the rate-36 branch's 36), then the projection; DeepLabV3+ then fuses with the
stride-4 map, reduced to 48 channels by a stage run as soon as that map is written, and
runs the head. FPN's is its top-down path, then each convolution of its
segmentation blocks and each GroupNorm after it, then merge and head: a GroupNorm's
statistic pass then reads a stored map instead of computing the decoder up to it again.

>>> from seg_at_scale.models.smp import SMPModel
>>> net = SMPModel("Unet", "tu-test_resnet", in_channels=4, num_classes=3,
...                options={"decoder_channels": [16, 16, 8, 8, 8]}).eval()
>>> [s.name for s in smp_stages(net)]
['encoder.conv1..act1', 'encoder.maxpool..layer1', 'encoder.layer2', 'encoder.layer3', \
'encoder.layer4', 'decoder+head']
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from segmentation_models_pytorch.base import SegmentationModel
from segmentation_models_pytorch.decoders.deeplabv3.decoder import (
    ASPP,
    DeepLabV3Decoder,
    DeepLabV3PlusDecoder,
)
from segmentation_models_pytorch.decoders.fpn.decoder import Conv3x3GNReLU, FPNDecoder
from segmentation_models_pytorch.encoders.resnet import ResNetEncoder
from segmentation_models_pytorch.encoders.timm_universal import TimmUniversalEncoder
from timm.models._features import FeatureListNet
from torch import Tensor, nn

from seg_at_scale.devices import module_device
from seg_at_scale.errors import ConfigError
from seg_at_scale.models.smp_tileable import non_local_modules, pooling_first, refusal
from seg_at_scale.tiling.staged import Chain, Stage, widest_tap
from seg_at_scale.tiling.staged.core_only import Shrinking, computes_core, core_of, shrinks

__all__ = ["smp_stages"]


class _Decode(nn.Module):
    """The last stage: smp's decoder on the feature list, then the segmentation head."""

    def __init__(self, decoder: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.decoder, self.head = decoder, head

    def forward(self, xs: list[Tensor]) -> Tensor:
        return self.head(self.decoder(list(xs)))


class _FusePlus(nn.Module):
    """DeepLabV3+'s decoder after ASPP (smp's forward from ``self.up`` on), then the head.

    It reads the stride-4 map through ``block1`` (1 x 1, 256 -> 48 channels, BatchNorm,
    ReLU), a stage of its own that runs right after the map is written (``_early``).
    """

    def __init__(self, decoder: DeepLabV3PlusDecoder, head: nn.Module) -> None:
        super().__init__()  # its modules only (not ASPP, whose pooling is another stage's)
        self.up, self.block2, self.head = decoder.up, decoder.block2, head

    def forward(self, xs: list[Tensor]) -> Tensor:
        aspp, high_res = xs  # high_res: block1's output
        fused = self.block2(torch.cat([self.up(aspp), high_res], dim=1))
        return self.head(fused)


class _Empty(nn.Module):
    """A transformer-style encoder's stride-2 feature: no channels (smp's placeholder)."""

    def forward(self, xs: list[Tensor]) -> Tensor:
        (x,) = xs
        return x.new_empty(x.shape[0], 0, x.shape[-2] // 2, x.shape[-1] // 2)


def smp_stages(model: nn.Module) -> list[Stage]:
    """The stages of an smp network (or an :class:`~seg_at_scale.models.smp.SMPModel`).

    Raises:
        ConfigError: the model is not an smp network, its encoder is neither smp's ResNet
            family nor a timm feature list (naming it and the fix), it has a
            classification head, or an operation
            needs the whole input (squeeze-excitation, attention: the exact-tiling refusal).
    """
    net: SegmentationModel = getattr(model, "net", model)  # smp's: its parts read as Any
    if not (hasattr(net, "encoder") and hasattr(net, "decoder")):
        raise ConfigError(f"staged=true: the model ({type(model).__name__}) is not an smp "
                          "network (model=smp / its presets); use staged=false")
    if getattr(net, "classification_head", None) is not None:
        raise ConfigError("staged=true: the model has a classification head (aux_params); "
                          "staged tiling predicts masks only: use staged=false")
    prefix = "net." if net is not model else ""  # as SMPModel.non_local names them
    found = [(prefix + n, k) for n, k in non_local_modules(net)]
    if found:  # a stage would see only its tile's statistics, as a whole-network tile would
        raise ConfigError(refusal("staged=true", found))
    chain = _encoder_chain(net.encoder)
    stages: list[Stage] = []
    for name, module, stride in chain:
        src = 0 if not stages or name == "empty" else _last_real(stages)
        if shrinks(module):  # ConvNeXt blocks: each computes what the next one reads
            module = Shrinking(module)
        stages.append(Stage(f"encoder.{name}", module, (src,), stride))
    stages = _stem_fused(stages + _decoder_stages(net, stages))
    stages = _early(stages, "decoder.block1")
    for st in stages:  # the wrappers take the network's mode (they hold its modules)
        st.module.train(net.training)
    return stages


def _stem_fused(stages: list[Stage]) -> list[Stage]:
    """The first encoder stage run inside the second where nothing else reads its map.

    FPN and DeepLab read the encoder's maps from stride 4 on, so the stem's stride-2 map
    (64 channels: as many bytes as the stride-4 map) was written and read back for the next
    stage alone: 9.7 GB each way at 12288^2. A U-Net's decoder reads it: kept.
    """
    if len(stages) < 2 or stages[1].inputs != (1,) or isinstance(stages[0].module, _Empty):
        return stages
    if any(1 in st.inputs for st in stages[2:]):
        return stages
    first, second = stages[:2]
    fused = Stage(f"{first.name}+{second.name.removeprefix('encoder.')}",
                  _Then(first.module, second.module), first.inputs, second.stride)
    return [fused] + [replace(st, inputs=tuple(i - 1 if i > 1 else i for i in st.inputs))
                      for st in stages[2:]]


def _early(stages: list[Stage], name: str) -> list[Stage]:
    """The stage ``name`` run right after the stage writing the last map it reads.

    DeepLabV3+'s ``block1`` reduces the stride-4 map (256 channels: 9.7 GB at 12288^2) to
    48 channels. Run last, beside the fusion, it read that map back after every deeper map
    had pushed it out of the page cache; run right after it is written, it reads it while
    it is there, and the map is dropped once layer2 has read it too.
    """
    k = next((i for i, st in enumerate(stages) if st.name == name), None)
    if k is None:
        return stages
    order = list(range(len(stages)))
    order.remove(k)
    order.insert(max(stages[k].inputs), k)  # map i is written by stage i - 1
    new = {0: 0} | {old + 1: pos + 1 for pos, old in enumerate(order)}
    return [replace(stages[old], inputs=tuple(new[i] for i in stages[old].inputs))
            for old in order]


class _Then(nn.Module):
    """Two stages as one: the second on the first's output."""

    def __init__(self, first: nn.Module, second: nn.Module) -> None:
        super().__init__()
        self.first, self.second = first, second

    def forward(self, xs: list[Tensor]) -> Tensor:
        return self.second([self.first(xs)])


def _decoder_stages(net: SegmentationModel, enc: list[Stage]) -> list[Stage]:
    """The decoder and head as stages after the encoder's (map ``k + 1``: stage ``k``'s)."""
    depth, head = len(enc), net.segmentation_head
    if isinstance(net.decoder, DeepLabV3PlusDecoder):
        # ASPP reads only the deepest map, whose stages are few tiles where the whole
        # decoder would take its 600-pixel halo at the stride-4 map's tile size
        aspp = _aspp_stages(net.decoder.aspp[0], Chain(*list(net.decoder.aspp)[1:]), depth,
                            enc[-1].stride, enc[-1].stride)
        high = Stage("decoder.block1", Chain(net.decoder.block1), (2,), enc[1].stride)
        return [*aspp, high, Stage("decoder.fuse+head", _FusePlus(net.decoder, head),
                                   (depth + len(aspp), depth + len(aspp) + 1), 1)]
    if isinstance(net.decoder, DeepLabV3Decoder):
        d = net.decoder
        return _aspp_stages(d.aspp, Chain(d.conv, d.bn, d.relu, head), depth,
                            enc[-1].stride, 1, "decoder.aspp.project+conv+head")
    if isinstance(net.decoder, FPNDecoder) and net.decoder.merge.policy == "add":
        return _fpn_stages(net.decoder, head, enc)
    return [Stage("decoder+head", _Decode(net.decoder, head), tuple(range(depth + 1)), 1)]


def _aspp_stages(aspp: ASPP, after: nn.Module, source: int, stride: int, out_stride: int,
                 last: str = "decoder.aspp.project") -> list[Stage]:
    """ASPP as stages: one per reach of its branches, then the projection with ``after``.

    The branches read map ``source`` (at ``stride``); the last stage ends at ``out_stride``.
    Every branch's pointwise convolution (2048 -> 256 channels on a ResNet-50) costs the
    same, so a tile of the rate-36 branch's halo around every branch did most of the
    ASPP's work on halo pixels; the image pooling rides with the 1 x 1 branch (reach 0),
    and comes first in it, so its statistic pass stops before the convolution.
    """
    groups: dict[int, list[int]] = {}
    for i, branch in enumerate(aspp.convs):
        groups.setdefault(widest_tap(branch), []).append(i)
    stages = [Stage(f"decoder.aspp.rate{r}" if r else "decoder.aspp.local",
                    _AsppBranches([aspp.convs[i] for i in idx]), (source,), stride)
              for r, idx in sorted(groups.items())]
    maps = tuple(source + 1 + k for k in range(len(stages)))
    project = _AsppProject(aspp.project, [idx for _, idx in sorted(groups.items())], after)
    return [*stages, Stage(last, project, maps, out_stride)]


class _AsppBranches(nn.Module):
    """Some of ASPP's branches (its own modules) on its input, concatenated in order.

    Branches with a whole-image statistic (the image pooling) run first. Dilated branches
    compute only the tile's core (``computes_core``,
    :func:`~seg_at_scale.tiling.staged.core_only.core_of`): their pointwise convolution then
    runs on the core, not on the rate-36 halo around it.
    """

    def __init__(self, branches: list[nn.Module]) -> None:
        super().__init__()
        self.branches = nn.ModuleList(branches)
        self.computes_core = all(map(computes_core, branches))

    def forward(self, xs: list[Tensor], core: tuple[slice, slice] | None = None,
                edges: tuple[bool, ...] | None = None) -> Tensor:
        (x,) = xs
        if core is not None:  # given only when computes_core (staged._run_stage)
            return torch.cat([core_of(b, x, *core) for b in self.branches], dim=1)
        return torch.cat(pooling_first(self.branches, x), dim=1)


class _AsppProject(nn.Module):
    """ASPP's projection of its branches' maps in smp's order, then ``after``.

    ``groups[k]``: the indices (in ``ASPP.convs``) of the branches whose outputs map ``k``
    holds.
    """

    def __init__(self, project: nn.Module, groups: list[list[int]], after: nn.Module) -> None:
        super().__init__()
        self.project, self.groups, self.after = project, groups, after

    def forward(self, xs: list[Tensor]) -> Tensor:
        by_branch: dict[int, Tensor] = {}
        for x, idx in zip(xs, self.groups, strict=True):
            by_branch.update(zip(idx, x.split(x.shape[1] // len(idx), dim=1), strict=True))
        y = self.project(torch.cat([by_branch[i] for i in sorted(by_branch)], dim=1))
        return self.after([y])


def _fpn_stages(dec: FPNDecoder, head: nn.Module, enc: list[Stage]) -> list[Stage]:
    """FPN's top-down path, then its segmentation blocks, convolution and norm apart.

    Every convolution is a stage and every GroupNorm (+ ReLU) the next, so a GroupNorm's
    statistic pass reads the stored convolution map instead of computing the decoder up to
    it again. A block's 2x upsampling runs in the stage that reads its map (the next
    convolution, or the merge), so the map is stored at its own stride: a quarter of the
    pixels (FPN-ResNet50 at 12288^2: 13 GB fewer map bytes written and read).
    """
    depth = len(enc)
    out: list[Stage] = []

    def add(name: str, module: nn.Module, inputs: tuple[int, ...], stride: int) -> int:
        out.append(Stage(f"decoder.{name}", module, inputs, stride))
        return depth + len(out)  # the map it writes

    c = {lvl: depth - 3 + i for i, lvl in enumerate((2, 3, 4, 5))}  # c2..c5: features[-4:]
    stride = {lvl: enc[c[lvl] - 1].stride for lvl in c}
    p = {5: add("p5", Chain(dec.p5), (c[5],), stride[5])}
    for lvl, block in ((4, dec.p4), (3, dec.p3), (2, dec.p2)):
        p[lvl] = add(f"p{lvl}", _TopDown(block), (p[lvl + 1], c[lvl]), stride[lvl])
    seg: list[tuple[int, nn.Module | None]] = []
    for k, lvl in enumerate((5, 4, 3, 2)):
        m, st, up = p[lvl], stride[lvl], None
        for j, cgr in enumerate(dec.seg_blocks[k].block):
            if up is not None:  # the previous block's upsampling, read from its smaller map
                st //= 2
            conv = Chain(cgr.block[0]) if up is None else Chain(up, cgr.block[0])
            m = add(f"seg_blocks.{k}.{j}.conv", conv, (m,), st)
            m = add(f"seg_blocks.{k}.{j}.norm", _NormUp(cgr), (m,), st)
            up = _Up2x(cgr) if cgr.upsample else None
        seg.append((m, up))
    add("merge+head", _MergeHead(dec, head, [u for _, u in seg]), tuple(m for m, _ in seg), 1)
    return out


class _TopDown(nn.Module):
    """One step of FPN's top-down path: ``block(upper level, encoder map)``."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, xs: list[Tensor]) -> Tensor:
        return self.block(xs[0], xs[1])


class _NormUp(nn.Module):
    """A Conv3x3GNReLU after its convolution: GroupNorm and ReLU.

    Its upsampling is ``_Up2x``, in the stage reading the map.
    """

    def __init__(self, cgr: Conv3x3GNReLU) -> None:
        super().__init__()
        self.cgr = cgr

    def forward(self, xs: list[Tensor]) -> Tensor:
        (x,) = xs
        for m in list(self.cgr.block)[1:]:
            x = m(x)
        return x


class _Up2x(nn.Module):
    """A Conv3x3GNReLU's 2x bilinear upsampling, as its forward runs it."""

    def __init__(self, cgr: nn.Module) -> None:
        super().__init__()
        self.align_corners = bool(getattr(cgr, "align_corners", True))

    def forward(self, x: Tensor) -> Tensor:
        return F.interpolate(x, scale_factor=2.0, mode="bilinear",
                             align_corners=self.align_corners)


class _MergeHead(nn.Module):
    """FPN's merge of the four segmentation maps, its dropout, then the head.

    A map whose block upsamples is upsampled here (``_Up2x``).
    """

    def __init__(self, dec: FPNDecoder, head: nn.Module, ups: list[nn.Module | None]) -> None:
        super().__init__()
        self.dec, self.head = dec, head
        self.ups = nn.ModuleList([u if u is not None else nn.Identity() for u in ups])

    def forward(self, xs: list[Tensor]) -> Tensor:
        maps = [up(x) for up, x in zip(self.ups, xs, strict=True)]
        return self.head(self.dec.dropout(self.dec.merge(maps)))


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
    raise ConfigError(f"staged=true: the encoder {type(enc).__name__} is not one whose "
                      "stages are known (smp's ResNet family, or a timm tu- encoder with a "
                      "feature list); use staged=false")


@torch.no_grad()
def _with_strides(enc: nn.Module, parts: list[tuple[str, nn.Module]]
                  ) -> list[tuple[str, nn.Module, int]]:
    """Each part's output stride, from one small forward of the chain."""
    size = 2 * int(getattr(enc, "output_stride", 32))
    channels = _in_channels(enc)
    x = torch.zeros(1, channels, size, size, device=module_device(enc))
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
    raise ConfigError(f"staged=true: no convolution in the encoder {type(enc).__name__}")
