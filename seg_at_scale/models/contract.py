"""The model contract: what every family gives, and the capabilities a family may add.

Every network the registry builds is a :class:`SegmentationNetwork`: it says its input
bands (``in_channels``), its classes (``num_classes``), its alignment
(``downsampling_factor``) and its :class:`~seg_at_scale.tiling.Footprint`. With that alone
it gets tiling, archives, export and sweeps. A family opts into more by implementing a
capability protocol; the code that uses a capability asks ``isinstance(model, Capability)``
and nothing else, and a model without it gets a one-line refusal naming what is missing
(:func:`require`).

The contract is checked once, when :func:`~seg_at_scale.models.registry.build_model` builds
a network (:func:`check_contract`): a family that breaks it fails there, naming the member,
not later inside a tiler.

>>> from seg_at_scale.models import UNet
>>> net = UNet(in_channels=4, num_classes=3, levels=3, base_width=4)
>>> check_contract(net) is net, isinstance(net, Pipelined), isinstance(net, FineTunable)
(True, True, False)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from torch import Tensor, nn

from seg_at_scale.errors import ConfigError
from seg_at_scale.protocols import Capability
from seg_at_scale.tiling.geometry import Footprint
from seg_at_scale.tiling.staged import Stage

__all__ = ["SegmentationNetwork", "Pipelined", "Checkpointable", "FineTunable",
           "ApproximateFootprint", "DualOutput", "Staged", "check_contract", "require",
           "CAPABILITIES"]


@runtime_checkable
class SegmentationNetwork(Capability, Protocol):
    """What every family gives: bands, classes, alignment and footprint.

    Attributes:
        in_channels: the input bands ``C`` of ``[B, C, H, W]``.
        num_classes: the classes ``K`` of the logits ``[B, K, H, W]``.
        downsampling_factor: the alignment: every tile window starts on this grid.
    """

    in_channels: int
    num_classes: int

    @property
    def downsampling_factor(self) -> int: ...

    def footprint(self) -> Footprint:
        """Halo, alignment and padding: what exact tiling needs."""
        ...

    def __call__(self, x: Tensor) -> Tensor: ...


@runtime_checkable
class Pipelined(Capability, Protocol):
    """The network as a flat layer list with named skips (pipelines, strip checkpointing)."""

    def pipeline_layers(self) -> list[nn.Module]: ...


@runtime_checkable
class Checkpointable(Capability, Protocol):
    """Where activation checkpointing finds its stages and blocks."""

    def checkpoint_roots(self) -> list[nn.Module]: ...


@runtime_checkable
class FineTunable(Capability, Protocol):
    """A pretrained encoder: its parameters (own learning rate, freezing), and its weights.

    ``weights_report`` says what pretrained weights were loaded (``{config key: report}``,
    empty when none): ``finetune.freeze_bn=auto`` reads it.
    """

    @property
    def weights_report(self) -> dict[str, str]: ...

    def encoder_parameters(self) -> Iterator[nn.Parameter]: ...


@runtime_checkable
class ApproximateFootprint(Capability, Protocol):
    """A network with non-local layers: the local receptive field, for inexact tiling."""

    def approximate_footprint(self) -> Footprint: ...


@runtime_checkable
class Staged(Capability, Protocol):
    """The network as stages, each tiled over the whole image's maps (``staged=true``)."""

    def stages(self) -> list[Stage]: ...


@runtime_checkable
class DualOutput(Capability, Protocol):
    """Segmentation and edge logits from one forward (Gated-SCNN's shape stream)."""

    def forward_dual(self, x: Tensor) -> tuple[Tensor, Tensor]: ...


#: capability -> what a user asks for that needs it
CAPABILITIES: dict[type, str] = {
    Pipelined: "pipelines and strip checkpointing (pipeline_layers)",
    Checkpointable: "activation checkpointing by stage or block (checkpoint_roots)",
    FineTunable: "fine-tuning a pretrained encoder (encoder_parameters)",
    ApproximateFootprint: "inexact tiling of non-local layers (approximate_footprint)",
    DualOutput: "edge supervision (forward_dual)",
    Staged: "stage-by-stage prediction (stages; smp networks)",
}


def check_contract(model: nn.Module) -> nn.Module:
    """``model``, after checking it satisfies :class:`SegmentationNetwork`.

    Raises:
        ConfigError: naming the class and the member it lacks or gets wrong.
    """
    name = type(model).__name__
    for attr in ("in_channels", "num_classes"):
        value = getattr(model, attr, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} breaks the model contract: {attr}={value!r} must be a "
                              "whole number >= 1 (see seg_at_scale.models.contract)")
    align = getattr(model, "downsampling_factor", None)
    if not isinstance(align, int) or align < 1:
        raise ConfigError(f"{name} breaks the model contract: downsampling_factor={align!r} "
                          "must be a whole number >= 1 (see seg_at_scale.models.contract)")
    if not callable(getattr(model, "footprint", None)):
        raise ConfigError(f"{name} breaks the model contract: it has no footprint() "
                          "(see seg_at_scale.models.contract)")
    return model


def require(model: object, capability: type, wanted: str, fix: str = "") -> None:
    """Refuse ``wanted`` in one line when ``model`` lacks ``capability``.

    Raises:
        ConfigError: ``<wanted> needs <what the capability gives>, which <Class> does not
            have[; <fix>]``.
    """
    if not isinstance(model, capability):
        raise ConfigError(f"{wanted} needs {CAPABILITIES.get(capability, capability.__name__)},"
                          f" which {type(model).__name__} does not have"
                          + (f"; {fix}" if fix else ""))
