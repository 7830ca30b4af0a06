"""segmentation-models-pytorch networks (any architecture, any smp or timm encoder), tiled exactly.

``SMPModel(arch="Unet", encoder="resnet34", in_channels=4, num_classes=5)`` builds
``smp.create_model`` with random weights, makes it exactly tileable
(:mod:`seg_at_scale.models.smp_tileable`), then loads weights from files:
``encoder_weights`` (a timm / torchvision / torchgeo state dict, a Lightning checkpoint's
encoder) and ``weights`` (a whole smp model's state dict trained elsewhere), both matched
by key and reported (:mod:`seg_at_scale.models.weights`), the first convolution adapted
to the input bands by ``band_map``. The weights' own normalisation is recorded in the
model (buffers ``input_mean`` / ``input_std`` / ``input_scale``, saved with every
checkpoint; NaN where unknown): :meth:`SMPModel.input_normalization`.

Tiling: the alignment is the encoder's output stride (32; 16 or 8 for dilated DeepLab
encoders), the halo is measured by the empirical probe (cached per architecture), and
whole-image statistics run in extra passes (:mod:`seg_at_scale.tiling.statistic_passes`).
Operations no pass can fix (squeeze-excitation, attention) make :meth:`SMPModel.footprint`
refuse exact tiling in one line naming the module; ``tiling.exact=false`` runs them on
overlapping tiles with the approximate halo (:meth:`SMPModel.approximate_footprint`, each
tile's centre kept): not the whole-image result.

>>> net = SMPModel("Unet", "tu-test_resnet", in_channels=4, num_classes=3,
...                options={"decoder_channels": [16, 16, 8, 8, 8]}).eval()
>>> net(torch.zeros(1, 4, 64, 96)).shape, net.downsampling_factor
(torch.Size([1, 3, 64, 96]), 32)
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
from collections.abc import Iterator
from typing import Any

import segmentation_models_pytorch as smp
import torch
from segmentation_models_pytorch.base import SegmentationModel
from torch import Tensor, nn

from seg_at_scale.devices import module_device
from seg_at_scale.errors import ConfigError, InputError
from seg_at_scale.models import weights as W
from seg_at_scale.models.smp_stage_split import smp_stages
from seg_at_scale.models.smp_tileable import (
    ASPPImagePool,
    make_exact,
    non_local_modules,
    refusal,
    skip_non_local,
)
from seg_at_scale.tiling.geometry import Footprint
from seg_at_scale.tiling.halo import WholeImageDependency, empirical_halo
from seg_at_scale.tiling.layout import prefer_layouts
from seg_at_scale.tiling.staged import Stage
from seg_at_scale.tiling.statistic_layers import site_levels, statistic_sites

__all__ = ["SMPModel", "ARCHITECTURES"]

log = logging.getLogger(__name__)

ARCHITECTURES = ("Unet", "UnetPlusPlus", "FPN", "PSPNet", "DeepLabV3", "DeepLabV3Plus",
                 "Linknet", "MAnet", "PAN", "UPerNet", "Segformer", "DPT")
_OWN = ("self", "kwargs", "encoder_name", "encoder_weights", "in_channels", "classes")
_HALOS: dict[tuple[Any, ...], int] = {}  # the probe's halo per architecture (not weights)
_FALLBACK: dict[tuple[Any, ...], str] = {}  # approximate halos not measured: why


class SMPModel(nn.Module):
    """An smp network with this project's tiling interface.

    Args:
        arch: smp architecture (:data:`ARCHITECTURES`).
        encoder: smp encoder name (``resnet34``) or a timm one as ``tu-<name>``.
        in_channels: input bands (``data.bands``).
        num_classes: output classes.
        options: further keyword arguments of the smp architecture (``decoder_channels``,
            ``encoder_depth``, ``encoder_output_stride``, ``decoder_atrous_rates``, ...).
        encoder_weights: a weights file for the encoder (or a hub name, online only).
        weights: a whole smp model's weights file (overrides ``encoder_weights``).
        band_map: pretrained input channel for each input band (null: starts at zero).
        align_corners: keep smp's size-dependent bilinear upsampling (not tile-exact).

    Shapes:
        ``[B, in_channels, H, W] -> [B, num_classes, H, W]``, H and W multiples of
        :attr:`downsampling_factor`.
    """

    padding = "same"
    net: SegmentationModel  # smp ships no type information: its parts read as Any
    input_mean: Tensor  # buffers
    input_std: Tensor
    input_scale: Tensor

    def __init__(self, arch: str = "Unet", encoder: str = "resnet34", in_channels: int = 3,
                 num_classes: int = 2, *, options: dict[str, Any] | None = None,
                 encoder_weights: str | None = None, weights: str | None = None,
                 band_map: list[int | None] | None = None, align_corners: bool = False) -> None:
        super().__init__()
        self.arch, self.encoder_name = arch, encoder
        self.in_channels, self.num_classes = in_channels, num_classes
        self.options = dict(options or {})
        self.align_corners = align_corners
        self.net = _create(arch, encoder, in_channels, num_classes, self.options)
        resampled = make_exact(self.net, align_corners=align_corners)
        prefer_layouts(self.net)  # DeepLab's dilated depthwise convolutions: NCHW on CPU
        f64 = torch.float64  # the statistics as written (a float32 0.485 reads 0.48500001)
        self.register_buffer("input_mean", torch.full((in_channels,), math.nan, dtype=f64))
        self.register_buffer("input_std", torch.full((in_channels,), math.nan, dtype=f64))
        self.register_buffer("input_scale", torch.tensor(math.nan, dtype=f64))
        self.weights_report: dict[str, str] = {}
        self._footprint: Footprint | None = None
        if band_map is not None and encoder_weights is None and weights is None:
            raise ConfigError(f"model.band_map={band_map} maps pretrained channels, but no "
                              "weights are given; set model.encoder_weights or model.weights")
        if encoder_weights is not None:
            self._load("model.encoder_weights", encoder_weights, self.net.encoder, band_map)
        if weights is not None:
            self._load("model.weights", weights, self.net, band_map)
            if resampled:  # the file's network upsampled otherwise: other logits than its own
                log.warning(
                    "model.weights '%s': smp's %s upsamples with align_corners=True (%d "
                    "places), which depends on the image size and no tiling reproduces; this "
                    "network upsamples with align_corners=False, so it predicts other logits "
                    "than the model the file holds (fine-tuning adapts them). To predict as "
                    "that model: model.align_corners=true tiling.exact=false (approximate "
                    "tiles)", weights, arch, resampled)

    # ----- weights ----------------------------------------------------------------------

    def _load(self, key: str, spec: str, module: nn.Module,
              band_map: list[int | None] | None) -> None:
        loaded = W.load_weights(module, spec, key=key, encoder=self.encoder_name,
                                in_channels=self.in_channels, band_map=band_map)
        self.weights_report[key] = loaded.report
        if loaded.normalization is not None:
            self._record_normalization(loaded.normalization, band_map, loaded.file_channels)

    def _record_normalization(self, norm: dict[str, Any], band_map: list[int | None] | None,
                              file_channels: int | None) -> None:
        per_band = W.band_normalization(norm, band_map, file_channels, self.in_channels)
        with torch.no_grad():
            for i, (mean, std) in enumerate(zip(per_band["mean"], per_band["std"],
                                                strict=True)):
                if mean is not None:
                    self.input_mean[i], self.input_std[i] = mean, std
            scale = per_band["scale"]
            self.input_scale.fill_(math.nan if scale is None else scale)

    def input_normalization(self) -> dict[str, Any] | None:
        """The weights' normalisation per input band, or None when no weights recorded one.

        Returns:
            ``{"mean": [...], "std": [...], "scale": float | None}``; a band the weights
            do not cover (mapped to zeros) has ``None`` entries.
        """
        if bool(torch.isnan(self.input_mean).all()):
            return None

        def plain(t: Tensor) -> list[float | None]:
            return [None if math.isnan(v) else v for v in t.tolist()]

        scale = float(self.input_scale)
        return {"mean": plain(self.input_mean), "std": plain(self.input_std),
                "scale": None if math.isnan(scale) else scale}

    # ----- forward ----------------------------------------------------------------------

    @property
    def downsampling_factor(self) -> int:
        """The alignment tiles need: the encoder's output stride."""
        return int(self.net.encoder.output_stride)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[B, num_classes, H, W]`` for ``[B, in_channels, H, W]``.

        Raises:
            InputError: an input smaller than the network takes (PAN: 128 px a side), in
                its words: torch's ("Output size is too small") came from a pooling layer
                deep inside.
        """
        try:
            return self.net(x)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            a, (h, w) = self.downsampling_factor, x.shape[-2:]
            if h % a or w % a:  # smp's own words say which multiple to pad to
                raise
            key = (self.arch, self.encoder_name, self.in_channels, repr(sorted(
                self.options.items())))
            if key in _PROBING:  # the probe's own forwards: torch's error is the answer
                raise
            _PROBING.add(key)
            try:
                smallest = _smallest_input(self, a)
            finally:
                _PROBING.discard(key)
            if min(h, w) >= smallest:
                raise
            raise InputError(
                f"model.arch={self.arch}: the network takes inputs of at least {smallest} x "
                f"{smallest} pixels, and this one is {h} x {w}; give a larger image (or pad "
                "it), or larger tiles") from None

    def encoder_parameters(self) -> Iterator[nn.Parameter]:
        """The encoder's parameters (fine-tuning: their own learning rate, freezing)."""
        return self.net.encoder.parameters()

    def checkpoint_roots(self) -> list[nn.Module]:
        """Where ``memory=checkpoint`` finds its stages and blocks: encoder and decoder."""
        return [self.net.encoder, self.net.decoder]

    # ----- tiling -----------------------------------------------------------------------

    def non_local(self) -> list[tuple[str, str]]:
        """Operations no tiling can reproduce (see :mod:`~seg_at_scale.models.smp_tileable`)."""
        return [(f"net.{n}", k) for n, k in non_local_modules(self.net)]

    def footprint(self) -> Footprint:
        """Halo (the empirical probe, statistics held) and alignment; refuses non-local nets.

        Raises:
            ConfigError: the network needs the whole input somewhere (named); the fixes
                are a local encoder or ``tiling.exact=false``.
        """
        if self._footprint is None:
            where = f"model.arch={self.arch} model.encoder={self.encoder_name}"
            found = self.non_local()
            if found:
                raise ConfigError(refusal(where, found))
            try:
                halo = self._halo()
            except WholeImageDependency as exc:
                raise ConfigError(refusal(where, [("the network", str(exc))])) from None
            self._footprint = Footprint(halo, self.downsampling_factor, "same", 0)
        return self._footprint

    def approximate_footprint(self) -> Footprint:
        """For ``tiling.exact=false``: the local receptive field, non-local modules skipped.

        The probe runs on a copy with squeeze-excitation and attention skipped and the
        upsampling translation-invariant (:func:`~seg_at_scale.models.smp_tileable.skip_non_local`);
        where the network still reaches the whole input, or the probe cannot run on it
        (MAnet, PAN), the halo is two alignment steps, and the log says why each time.
        Tiles with this halo are *not* exact (overlapping tiles, each core kept).
        """
        key = ("approximate", self.arch, self.encoder_name, self.in_channels,
               repr(sorted(self.options.items())), self.align_corners)
        if key not in _HALOS:
            a = self.downsampling_factor
            twin = copy.deepcopy(self).cpu().eval()  # the probe runs on the CPU
            try:
                skip_non_local(twin.net, torch.zeros(1, self.in_channels, 2 * a, 2 * a))
                _HALOS[key] = empirical_halo(twin, align=a)
            except WholeImageDependency:
                _FALLBACK[key] = "the network needs the whole image even with its non-local " \
                                 "modules skipped"
            except (RuntimeError, ValueError) as exc:  # MAnet, PAN: the probe cannot run
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                _FALLBACK[key] = ("the halo probe fails on the network with its non-local "
                                  f"modules skipped ({reason.split(';')[0][:160]})")
            if key in _FALLBACK:  # every tile at least the input the network takes (PAN)
                smallest = _smallest_input(self, a)
                _HALOS[key] = max(2 * a, a * math.ceil((smallest - a) / (2 * a)))
        halo = _HALOS[key]
        if key in _FALLBACK:  # said each time it is taken
            log.warning("tiling.exact=false with model.arch=%s model.encoder=%s: %s, so its "
                        "approximate halo is %d px (two alignment steps, or more where the "
                        "network takes no smaller tile); tiling.halo=<pixels> gives tiles a "
                        "wider overlap", self.arch, self.encoder_name, _FALLBACK[key], halo)
        return Footprint(halo, self.downsampling_factor, "same", 0)

    def _halo(self) -> int:
        key = (self.arch, self.encoder_name, self.in_channels, repr(sorted(
            self.options.items())), self.align_corners)
        if key not in _HALOS:
            _HALOS[key] = empirical_halo(self, align=self.downsampling_factor)
        return _HALOS[key]

    # ----- the ImagePooled protocol (seg_at_scale.tiling.statistics) --------------------

    @property
    def has_image_pool(self) -> bool:
        """Whether a statistic (DeepLab pooling, GroupNorm) still needs computing.

        False once every site holds its whole-image value
        (:func:`seg_at_scale.tiling.statistic_passes.fixed_statistics`): a tiler then runs one pass.
        """
        return any(s.fixed is None for _, s in statistic_sites(self))

    def pooled_features(self, x: Tensor) -> Tensor:
        """DeepLab: the encoder features ``[B, C, h, w]`` its image pooling averages.

        Raises:
            ConfigError: statistics in more than one place (FPN's GroupNorms), which need
                :func:`seg_at_scale.tiling.statistic_passes.fixed_statistics` instead of one pass.
        """
        self._single_pool()
        return self.net.encoder(x)[-1]

    @contextlib.contextmanager
    def fixed_image_pool(self, pooled: Tensor | None) -> Iterator[None]:
        """Within the block, DeepLab's image pooling uses ``pooled [B, C, 1, 1]``."""
        if pooled is None or not self.has_image_pool:
            yield
            return
        site = self._single_pool()
        before, site.fixed = site.fixed, pooled
        try:
            yield
        finally:
            site.fixed = before

    def _single_pool(self) -> ASPPImagePool:
        sites = [s for _, s in statistic_sites(self)]
        if len(sites) == 1 and isinstance(sites[0], ASPPImagePool):
            return sites[0]
        names = ", ".join(n for n, _ in statistic_sites(self))
        raise ConfigError(f"model.arch={self.arch}: whole-image statistics at {names} need "
                          "one pass per level "
                          "(seg_at_scale.tiling.statistic_passes.fixed_statistics), "
                          "not the single image-pooling pass")

    def stages(self) -> list[Stage]:
        """The network as stages run one after another over the whole image (``staged=true``).

        Raises:
            ConfigError: an encoder or head the stages do not cover, or a non-local layer
                (:func:`~seg_at_scale.models.smp_stage_split.smp_stages` names it and the fix).
        """
        return smp_stages(self)

    def statistic_levels(self) -> int:
        """Extra passes over the tiles exact tiling needs (0: none)."""
        a = self.downsampling_factor
        levels = site_levels(self, torch.zeros(1, self.in_channels, 2 * a, 2 * a,
                                               device=module_device(self)))
        return max(levels.values(), default=0)


#: networks whose smallest input is being probed (their failed forwards are the probe's)
_PROBING: set[tuple[Any, ...]] = set()


def _smallest_input(model: SMPModel, align: int, most: int = 16) -> int:
    """The smallest square input, in alignment steps, the network runs on (PAN: 128 px)."""
    twin = copy.deepcopy(model).cpu().eval()
    for k in range(1, most + 1):
        try:
            with torch.no_grad():
                twin(torch.zeros(1, model.in_channels, k * align, k * align))
        except (RuntimeError, ValueError):
            continue
        return k * align
    return most * align


def _create(arch: str, encoder: str, in_channels: int, num_classes: int,
            options: dict[str, Any]) -> nn.Module:
    if arch not in ARCHITECTURES:
        raise ConfigError(f"model.arch={arch!r} is not an smp architecture; use one of "
                          f"{', '.join(ARCHITECTURES)}")
    if not encoder.startswith("tu-") and encoder not in smp.encoders.get_encoder_names():
        raise ConfigError(f"model.encoder={encoder!r} is not an smp encoder; use one of "
                          "smp's (resnet34, efficientnet-b0, mit_b0, ...) or a timm model as "
                          "tu-<name> (tu-convnext_tiny)")
    known = inspect.signature(getattr(smp, arch).__init__).parameters
    unknown = sorted(set(options) - set(known) - {"self", "kwargs"})
    if unknown and not encoder.startswith("tu-"):  # smp hands extra keywords to timm only
        raise ConfigError(f"model.options has {unknown}, not keywords of smp.{arch} (its "
                          f"keywords: {', '.join(k for k in known if k not in _OWN)})")
    try:
        return smp.create_model(arch, encoder_name=encoder, encoder_weights=None,
                                in_channels=in_channels, classes=num_classes, **options)
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"model.arch={arch} model.encoder={encoder} "
                          f"model.options={options}: smp refuses them ({exc})") from None
