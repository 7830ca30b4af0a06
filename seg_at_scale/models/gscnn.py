"""Gated-SCNN (Takikawa et al. 2019, "Gated Shape CNNs for Semantic Segmentation").

Written from the paper. Three parts:

* **regular stream**: a ResNet-style backbone (stem, four stages of residual blocks), output
  stride 8 as in the paper: stages 3 and 4 keep the resolution and dilate instead;
* **shape stream**: full-resolution residual blocks interleaved with gated convolutional
  layers (GCL): ``alpha = sigmoid(conv1x1(concat(s, up(r))))``, ``s <- conv1x1(s * alpha + s)``,
  driven by the regular stream's stage 1, 2 and 4 features; its 1-channel output is the
  boundary map (logits);
* **fusion**: the boundary map (as a probability) is concatenated with the image gradient
  (a Canny band computed in the data pipeline and stored as an extra input band, never
  computed here) and squeezed to one attention channel, which feeds the ASPP head as an
  extra branch beside the paper's image-level pooling; a DeepLab-v3+-style decoder with the
  stage 1 features gives the segmentation logits.

``model(x)`` returns the segmentation logits ``[B, K, H, W]`` (``output="seg"``), so
``seg_at_scale.tiling.predict_tiled`` works unchanged; ``forward_dual`` returns
``(seg, boundary)``; ``output="packed"`` returns both in one tensor ``[B, K + 1, H, W]``
(for pipelines, which carry a single tensor; :func:`unpack` splits it).

**Exactness.** The image-level pooling branch averages the last backbone features over the
whole input, so a tile alone does not see the statistic the whole image would. Inference
is made exact in two passes (:func:`seg_at_scale.tiling.predict_tiled_two_pass`): pass 1
runs the backbone over the tiles and averages the core features, pass 2 runs the tiles with
that average fixed (:meth:`GSCNN.fixed_image_pool`);
:func:`~seg_at_scale.tiling.tiled_backward_two_pass` does the same for
the exact whole-image gradient. The halo is the receptive field with the pooled value
held constant, measured by :func:`seg_at_scale.tiling.empirical_halo` on a 1-channel twin of
the architecture (the receptive field depends on kernels, strides and dilations only).
Train-mode BatchNorm still sees tile statistics (``norm="none"`` or frozen statistics for
exact tiled training).

>>> net = GSCNN.from_preset("tiny", in_channels=4, num_classes=3).eval()
>>> seg, edge = net.forward_dual(torch.zeros(1, 4, 64, 48))
>>> tuple(seg.shape), tuple(edge.shape), net.downsampling_factor
((1, 3, 64, 48), (1, 1, 64, 48), 8)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, cast

import torch
from torch import Tensor, nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.models.gscnn_backbone import regular_stream
from seg_at_scale.models.gscnn_parts import (
    ASPP,
    STRIDE,
    Decoder,
    EdgeFusion,
    GatedConv,
    ResBlock,
    ShapeIn,
    conv_block,
)
from seg_at_scale.models.layers import Skip
from seg_at_scale.tiling.geometry import Footprint
from seg_at_scale.tiling.halo import empirical_halo

__all__ = ["GSCNN", "GSCNNSize", "GSCNN_SIZES", "unpack"]


@dataclass(frozen=True)
class GSCNNSize:
    """Depth and width of a Gated-SCNN preset.

    Attributes:
        stem_width: channels of the two stem convolutions (output at 1/2).
        widths: channels of the four backbone stages (1/4, 1/8, 1/8 dilated 2, 1/8 dilated 4).
        blocks: residual blocks per stage.
        shape_widths: channels of the shape stream's three residual block + GCL stages.
        aspp_width: channels of each ASPP branch.
        aspp_rates: dilations of the three 3 x 3 ASPP branches (the paper: 12, 24, 36 at
            output stride 8).
        decoder_width: channels of the decoder convolutions.
    """

    stem_width: int
    widths: tuple[int, ...]  # 4 (checked where a model is built)
    blocks: tuple[int, ...]  # 4
    shape_widths: tuple[int, ...]  # 3
    aspp_width: int
    aspp_rates: tuple[int, ...]  # 3
    decoder_width: int


GSCNN_SIZES: dict[str, GSCNNSize] = {
    "tiny": GSCNNSize(8, (8, 16, 16, 16), (1, 1, 1, 1), (8, 8, 4), 16, (1, 2, 3), 16),
    "small": GSCNNSize(16, (24, 32, 64, 64), (1, 1, 2, 1), (16, 8, 8), 32, (2, 4, 6), 32),
    "medium": GSCNNSize(32, (64, 128, 256, 256), (2, 2, 3, 2), (32, 16, 8), 128, (6, 12, 18),
                        128),
    # in the spirit of the paper's WideResNet38 backbone (width 64 -> 1024, 15 blocks)
    "wide": GSCNNSize(64, (128, 256, 512, 1024), (3, 3, 6, 3), (64, 32, 16), 256, (12, 24, 36),
                      256),
}


class _SelectBands(nn.Module):
    keep: Tensor  # a buffer

    def __init__(self, drop: int | None, channels: int) -> None:
        super().__init__()
        keep = [c for c in range(channels) if drop is None or c != drop % channels]
        self.register_buffer("keep", torch.tensor(keep), persistent=False)
        self.all = len(keep) == channels

    def forward(self, x: Tensor) -> Tensor:
        return x if self.all else x.index_select(1, self.keep)


class _Take(nn.Module):
    """Pipeline helper: continue with the popped value.

    ``x`` (already stashed) is kept in the graph by adding ``0 * x.sum()`` (exactly +0.0):
    fairscale's Pipe back-propagates into a partition only through its flowing output, so
    dropping ``x`` would cut the gradient of every feature the partition stashed.
    """

    def forward(self, x: Tensor, popped: Tensor) -> Tensor:
        return popped + 0 * x.sum()


class _Swap(nn.Module):
    """Pipeline helper: ``body(popped, x)`` (the flowing value is the second argument)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: Tensor, popped: Tensor) -> Tensor:
        return self.body(popped, x)


class _Finish(nn.Module):
    """Pipeline helper: pack ``[seg, boundary]`` or drop the boundary."""

    def __init__(self, packed: bool) -> None:
        super().__init__()
        self.packed = packed

    def forward(self, seg: Tensor, edge: Tensor) -> Tensor:
        return torch.cat([seg, edge], dim=1) if self.packed else seg


def unpack(y: Tensor) -> tuple[Tensor, Tensor]:
    """Split a packed output ``[B, K + 1, H, W]`` into ``(seg, boundary [B, 1, H, W])``."""
    return y[:, :-1], y[:, -1:]


class GSCNN(nn.Module):
    """Gated-SCNN: regular stream, gated shape stream, fusion with ASPP.

    Args:
        in_channels: input bands, including the Canny band when ``edge_band`` is set.
        num_classes: K.
        stem_width, widths, blocks, shape_widths, aspp_width, aspp_rates, decoder_width:
            see :class:`GSCNNSize` (:meth:`from_preset` fills them from a preset).
        edge_band: index of the image-gradient (Canny) band in the input, or None when the
            input has none; the regular stream sees the other bands.
        norm: ``"batch"`` (the paper) or ``"none"`` (exact tiled training).
        image_pool: keep the paper's image-level pooling branch in ASPP (whole-image
            statistic: exact tiling needs :func:`~seg_at_scale.tiling.predict_tiled_two_pass`).
        output: what ``forward`` returns: ``"seg"`` logits or ``"packed"`` ``[seg, boundary]``.
        padding: only ``"same"`` (accepted so configs can name it like the U-Net's).
        backbone: a timm network as the regular stream (``resnet101``, ``wide_resnet50_2``:
            :class:`~seg_at_scale.models.gscnn_backbone.TimmBackbone`, the paper's setting);
            it replaces ``stem_width``, ``widths`` and ``blocks``. None: the built-in one.
        backbone_weights: the backbone's weights file (timm / torchvision / torchgeo layout).
        band_map: pretrained input channel for each band the backbone reads (null: zeros).
        **unknown: refused with a :class:`ConfigError` naming them.

    Shapes:
        ``[B, in_channels, H, W] -> [B, K, H, W]`` (packed: ``K + 1``); H and W multiples of 8.
    """

    downsampling_factor = STRIDE

    def __init__(self, in_channels: int = 4, num_classes: int = 7, *, stem_width: int = 16,
                 widths: Sequence[int] = (24, 32, 64, 64), blocks: Sequence[int] = (1, 1, 2, 1),
                 shape_widths: Sequence[int] = (16, 8, 8), aspp_width: int = 32,
                 aspp_rates: Sequence[int] = (2, 4, 6), decoder_width: int = 32,
                 edge_band: int | None = -1, norm: str = "batch", image_pool: bool = True,
                 output: str = "seg", padding: str = "same", backbone: str | None = None,
                 backbone_weights: str | None = None, band_map: list[int | None] | None = None,
                 **unknown: object) -> None:
        super().__init__()
        if unknown:
            raise ConfigError(
                f"Gated-SCNN got unknown model keys {sorted(unknown)} (a U-Net size?); "
                f"use model=gscnn_<{'|'.join(GSCNN_SIZES)}>")
        self.size = GSCNNSize(stem_width, tuple(widths), tuple(blocks), tuple(shape_widths),
                              aspp_width, tuple(aspp_rates), decoder_width)
        _check(self.size, in_channels, num_classes, edge_band, norm, output, padding)
        self.in_channels, self.num_classes = in_channels, num_classes
        self.edge_band, self.norm, self.output = edge_band, norm, output
        self.select = _SelectBands(edge_band, in_channels)
        cin = in_channels - (edge_band is not None)
        if band_map is not None and edge_band is not None and len(band_map) != cin:
            raise ConfigError(f"model.band_map={list(band_map)} has {len(band_map)} entries, "
                              f"and the backbone reads {cin} bands: the {in_channels} input "
                              f"bands less the Canny band (model.edge_band={edge_band}); give "
                              "one pretrained channel (or null) per band it reads")
        self.regular = regular_stream(backbone, cin, backbone_weights, band_map)
        if self.regular is not None:  # the backbone's widths drive the other parts
            stem_width, widths = self.regular.channels[0], tuple(self.regular.channels[1:])
            self.size = replace(self.size, stem_width=stem_width, widths=widths)
        else:
            self.stem = nn.Sequential(conv_block(cin, stem_width, 3, norm),
                                      conv_block(stem_width, stem_width, 3, norm, stride=2))
            self.stages = nn.ModuleList()
            prev = stem_width
            for k, (w, n) in enumerate(zip(widths, blocks)):
                stride, dil = (2, 1) if k < 2 else (1, 2 ** (k - 1))
                self.stages.append(nn.Sequential(*[
                    ResBlock(prev if i == 0 else w, w, norm, stride=stride if i == 0 else 1,
                             dilation=dil) for i in range(n)]))
                prev = w
        sides = (widths[0], widths[1], widths[3])  # stage 1, 2 and 4 drive the shape stream
        self.shape_in = ShapeIn(stem_width, shape_widths[0])
        self.shape_blocks = nn.ModuleList(ResBlock(c, c, norm) for c in shape_widths)
        outs = list(shape_widths[1:]) + [shape_widths[-1]]
        self.gates = nn.ModuleList(GatedConv(c, r, o) for c, r, o in
                                   zip(shape_widths, sides, outs))
        self.shape_out = nn.Conv2d(shape_widths[-1], 1, 1)
        self.fusion = EdgeFusion(edge_band)
        self.aspp = ASPP(widths[3], aspp_width, aspp_rates, norm, image_pool)
        self.decoder = Decoder(aspp_width, widths[0], decoder_width, num_classes, norm)
        self._footprint: Footprint | None = None

    @classmethod
    def from_preset(cls, name: str, **kwargs: Any) -> GSCNN:
        """A model from a :data:`GSCNN_SIZES` preset; ``kwargs`` as for the constructor."""
        if name not in GSCNN_SIZES:
            raise ConfigError(f"Gated-SCNN size {name!r} is unknown; use one of "
                              f"{sorted(GSCNN_SIZES)}")
        return cls(**asdict(GSCNN_SIZES[name]), **kwargs)

    @property
    def weights_report(self) -> dict[str, str]:
        """What pretrained weights were loaded (fine-tuning's ``freeze_bn=auto`` reads it)."""
        rep = self.regular.report if self.regular is not None else ""
        return {"model.backbone_weights": rep} if rep else {}

    def input_normalization(self) -> dict[str, Any] | None:
        """The backbone weights' normalisation per input band (``finetune.normalization``).

        None without weights that record one; the Canny band, which the backbone does not
        read, has ``None`` entries (it keeps the data's values).
        """
        norm = self.regular.normalization if self.regular is not None else None
        if norm is None:
            return None
        edge = None if self.edge_band is None else self.edge_band % self.in_channels
        mean, std = iter(norm["mean"]), iter(norm["std"])
        per_band = [(None, None) if i == edge else (next(mean), next(std))
                    for i in range(self.in_channels)]
        return {"mean": [m for m, _ in per_band], "std": [s for _, s in per_band],
                "scale": norm["scale"]}

    def encoder_parameters(self) -> Iterator[nn.Parameter]:
        """The timm backbone's parameters (fine-tuning); none for the built-in stream."""
        return self.regular.parameters() if self.regular is not None else iter(())

    # ----- forward ----------------------------------------------------------------------

    def backbone(self, x: Tensor) -> list[Tensor]:
        """Regular stream: ``[stem (1/2), stage1 (1/4), stage2 (1/8), stage3, stage4]``."""
        _check_input(x, self.in_channels)
        if self.regular is not None:
            return self.regular(self.select(x))
        feats = [self.stem(self.select(x))]
        for stage in self.stages:
            feats.append(stage(feats[-1]))
        return feats

    def forward_dual(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(seg logits [B, K, H, W], boundary logits [B, 1, H, W])``."""
        stem, f1, f2, _, f4 = self.backbone(x)
        s = self.shape_in(stem)
        for block, gate, side in zip(self.shape_blocks, self.gates, (f1, f2, f4)):
            s = gate(block(s), side)
        edge = self.shape_out(s)
        fused = self.fusion(edge, x)
        seg = self.decoder(self.aspp(f4, fused), f1)
        return seg, edge

    def forward(self, x: Tensor) -> Tensor:
        """Segmentation logits ``[B, K, H, W]`` (or ``[seg, boundary]`` when packed)."""
        seg, edge = self.forward_dual(x)
        return torch.cat([seg, edge], dim=1) if self.output == "packed" else seg

    def checkpoint_roots(self) -> list[nn.Module]:
        """Where ``memory=checkpoint`` finds stages and blocks when there is no flat form.

        That is on a timm backbone: the regular stream, the shape stream's blocks, ASPP and
        decoder.
        """
        regular = [self.regular] if self.regular is not None else list(self.stages)
        return [*regular, self.shape_blocks, self.aspp, self.decoder]

    @contextlib.contextmanager
    def packed_output(self) -> Iterator[None]:
        """Within the block ``forward`` (and the flat form) return ``[seg, boundary]`` packed."""
        before, self.output = self.output, "packed"
        try:
            yield
        finally:
            self.output = before

    # ----- flat form --------------------------------------------------------------------

    def pipeline_layers(self) -> list[nn.Module]:
        """The network as a flat layer list with named skips (this model's own modules).

        The input is stashed for the Canny band, the backbone's side features are stashed
        as ``low``/``side1``/``side2``/``side3``/``feat``, and the shape stream pops them;
        the last layer packs or drops the boundary as ``output`` says, so
        ``run_layers(net.pipeline_layers(), x)`` equals ``net(x)`` exactly.

        Raises:
            ConfigError: a timm backbone (no flat form: pipelines do not apply;
                checkpointing uses :meth:`checkpoint_roots`).
        """
        if self.regular is not None:
            raise ConfigError(f"Gated-SCNN with model.backbone={self.regular.name!r} has no "
                              "flat layer form; use pipeline=none (memory=checkpoint "
                              "recomputes its stages or blocks instead)")
        layers: list[nn.Module] = []
        if self.edge_band is not None:
            layers.append(Skip(nn.Identity(), stash=("input",)))
        layers += [self.select, self.stem[0], Skip(self.stem[1], stash=("shape",))]
        stash = {0: ("low", "side1"), 1: ("side2",), 3: ("side3", "feat")}
        for k, stage in enumerate(self.stages):
            blocks = list(cast(nn.Sequential, stage))
            layers += blocks[:-1]
            layers.append(Skip(blocks[-1], stash=stash[k]) if k in stash else blocks[-1])
        layers += [Skip(_Take(), pop=("shape",)), self.shape_in]
        for k, (block, gate) in enumerate(zip(self.shape_blocks, self.gates)):
            layers += [block, Skip(gate, pop=(f"side{k + 1}",))]
        layers.append(Skip(self.shape_out, stash=("edge",)))
        layers.append(Skip(self.fusion, pop=("input",)) if self.edge_band is not None
                      else self.fusion)
        layers += [Skip(_Swap(self.aspp), pop=("feat",)), Skip(self.decoder, pop=("low",)),
                   Skip(_Finish(self.output == "packed"), pop=("edge",))]
        return layers

    # ----- tiling -----------------------------------------------------------------------

    @contextlib.contextmanager
    def fixed_image_pool(self, pooled: Tensor | None) -> Iterator[None]:
        """Within the block, image pooling uses ``pooled [B, C, 1, 1]`` instead of the mean."""
        pool = self.aspp.pool
        if pool is None:
            yield
            return
        before, pool.fixed = pool.fixed, pooled
        try:
            yield
        finally:
            pool.fixed = before

    @property
    def has_image_pool(self) -> bool:
        """Whether the ASPP averages over the whole input (image-level pooling)."""
        return self.aspp.pool is not None

    def pooled_features(self, x: Tensor) -> Tensor:
        """The features ``[B, C, h, w]`` (at ``downsampling_factor``) the image pooling averages."""
        return self.backbone(x)[-1]

    def pooled_width(self) -> int:
        """Channels of the features that the image-level pooling averages."""
        return self.size.widths[3]

    def footprint(self) -> Footprint:
        """Halo from the empirical receptive-field probe, image pooling held constant.

        Measured on a twin of the architecture with one channel per layer (same kernels,
        strides, dilations: the receptive field does not depend on widths), once per
        geometry and process, so it costs seconds even for the wide preset.
        """
        if self._footprint is None and self.regular is not None:
            key = (self.regular.name, self.in_channels, self.edge_band, self.aspp.pool is not None,
                   self.size)
            if key not in _BACKBONE_HALOS:  # the probe on the model itself, image pool held
                _BACKBONE_HALOS[key] = empirical_halo(self, align=STRIDE)
            self._footprint = Footprint(_BACKBONE_HALOS[key], STRIDE, "same", 0)
        if self._footprint is None:
            geometry = replace(self.size, stem_width=1, widths=(1, 1, 1, 1),
                               shape_widths=(1, 1, 1), aspp_width=1, decoder_width=4)
            halo = _twin_halo(geometry, self.in_channels, self.edge_band, self.norm,
                              self.aspp.pool is not None)
            self._footprint = Footprint(halo, STRIDE, "same", 0)
        return self._footprint


_BACKBONE_HALOS: dict[tuple[object, ...], int] = {}


@functools.lru_cache(maxsize=16)
def _twin_halo(geometry: GSCNNSize, in_channels: int, edge_band: int | None, norm: str,
               image_pool: bool) -> int:
    twin = GSCNN(in_channels, 1, **asdict(geometry), edge_band=edge_band, norm=norm,
                 image_pool=image_pool, output="packed")
    with twin.fixed_image_pool(torch.zeros(1, 1, 1, 1, dtype=torch.float64)):
        return empirical_halo(twin, align=STRIDE)


def _check(size: GSCNNSize, in_channels: int, num_classes: int, edge_band: int | None,
           norm: str, output: str, padding: str) -> None:
    if len(size.widths) != 4 or len(size.blocks) != 4 or min(size.blocks) < 1:
        raise ConfigError(f"model.widths {list(size.widths)} and model.blocks "
                          f"{list(size.blocks)} need 4 entries each, blocks >= 1")
    if len(size.shape_widths) != 3 or len(size.aspp_rates) != 3:
        raise ConfigError(f"model.shape_widths {list(size.shape_widths)} and model.aspp_rates "
                          f"{list(size.aspp_rates)} need 3 entries each")
    if norm not in ("batch", "none"):
        raise ConfigError(f"model.norm={norm!r}: use 'batch' or 'none'")
    if output not in ("seg", "packed"):
        raise ConfigError(f"model.output={output!r}: use 'seg' or 'packed'")
    if padding != "same":
        raise ConfigError(f"model.padding={padding!r}: Gated-SCNN supports 'same' only")
    low = 2 if edge_band is not None else 1
    if in_channels < low or num_classes < 1:
        raise ConfigError(f"model.in_channels={in_channels} (num_classes={num_classes}): "
                          f"need >= {low} bands (image + Canny band when edge_band is set)")
    if edge_band is not None and not -in_channels <= edge_band < in_channels:
        raise ConfigError(f"model.edge_band={edge_band} is not a band of {in_channels}; "
                          "give the Canny band's index (-1 = last) or null")


def _check_input(x: Tensor, channels: int) -> None:
    if x.dim() != 4 or x.shape[1] != channels:
        raise ValueError(f"Gated-SCNN expects [B, {channels}, H, W], got {list(x.shape)}")
    h, w = x.shape[-2:]
    if h % STRIDE or w % STRIDE:
        raise ValueError(f"Gated-SCNN input {h} x {w}: sides must be multiples of {STRIDE} "
                         "(tiling pads to them; for a bare call pad the image first)")
