"""The model card, typed: what a run or an exported model says about its network.

A card is plain JSON-able data: made from a training config
(:func:`~seg_at_scale.models.trained.card_of_config`), stored beside the weights of a
``.segmodel`` (:mod:`seg_at_scale.models.segmodel`, which checks an untrusted one key by key
before anything is built). :class:`ModelCard` reads it once into typed fields; everything
after that reads the fields, never the keys. ``raw`` is the card as it was given, written
back as it was (an exported card's bytes do not change).

>>> card = ModelCard.of({"model": {"family": "unet", "levels": 3},
...     "footprint": {"halo": 44, "align": 8, "padding": "same", "out_residue": 0},
...     "data": {"bands": 4, "num_classes": 3, "class_names": ["a", "b", "c"],
...              "ignore_index": 255, "normalization": {"scale": 0.004, "mean": [0.5],
...                                                     "std": [0.25]}}})
>>> card.bands, card.footprint.halo, card.exact, card.family
(4, 44, True, 'unet')
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.errors import InputError
from seg_at_scale.tiling.geometry import Footprint, Padding

__all__ = ["ModelCard"]


@dataclass(frozen=True)
class ModelCard:
    """A model card's fields.

    Attributes:
        family: the registry's family name (``unet``, ``smp``, ...), or None.
        model: the model node: its family's keys (what the registry builds from).
        footprint: halo, alignment, padding and size residue the network is tiled with.
        exact: False for a run trained with ``tiling.exact=false`` (approximate footprint).
        bands / num_classes / class_names / ignore_index: the data it was trained on.
        colours: the preview's class colours, where recorded.
        scale / mean / std: the input normalisation (raw samples to model input).
        input: the training imagery's ``dtype`` and ``high``, where recorded.
        metrics: the run's scores, where recorded.
        raw: the card as given (JSON-able), written back unchanged.
    """

    family: str | None
    model: dict[str, Any]
    footprint: Footprint
    exact: bool
    bands: int
    num_classes: int
    class_names: tuple[str, ...]
    colours: tuple[tuple[int, ...], ...] | None
    ignore_index: int
    scale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]
    input: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, card: Mapping[str, Any]) -> ModelCard:
        """The typed card of a card's data (checked by its reader where untrusted)."""
        f, data = card["footprint"], card["data"]
        node = dict(card.get("model") or {})
        n = data["normalization"]
        k = int(data["num_classes"])
        names = data.get("class_names") or [f"class_{i}" for i in range(k)]
        colours = data.get("colours")
        return cls(
            family=node.get("family"),
            model={key: v for key, v in node.items() if key != "family"},
            footprint=Footprint(int(f["halo"]), int(f["align"]),
                                cast(Padding, str(f["padding"])),  # Footprint checks it
                                int(f.get("out_residue", 0))),
            exact=bool(card.get("exact", True)), bands=int(data["bands"]), num_classes=k,
            class_names=tuple(str(c) for c in names),
            colours=None if colours is None else tuple(tuple(int(v) for v in c)
                                                       for c in colours),
            ignore_index=int(data["ignore_index"]), scale=float(n["scale"]),
            mean=tuple(float(v) for v in n["mean"]), std=tuple(float(v) for v in n["std"]),
            input=dict(data.get("input") or {}), metrics=card.get("metrics"),
            raw=dict(card))

    @property
    def planes(self) -> int:
        """Label maps per pixel: more than 1 for a network of detector planes.

        A model key ``planes`` (UResNet's) labels each plane apart: its logits hold
        ``planes x num_classes`` channels.
        """
        planes = self.model.get("planes", 1)
        return planes if isinstance(planes, int) and not isinstance(planes, bool) else 1

    def normalizer(self, source: str) -> Normalizer:
        """The input normalisation; a scale or std that is not > 0 is refused."""
        n = self.raw.get("data", {}).get("normalization", {})  # the values as written
        bad = [i for i, v in enumerate(self.std) if not v > 0]
        if bad or not self.scale > 0:
            what = (f"std {n.get('std', self.std)[bad[0]]} for band {bad[0]}" if bad else
                    f"scale {n.get('scale', self.scale)}")
            raise InputError(f"{source}: the normalisation has {what}, which must be > 0 (it "
                             "divides); the config was edited: restore it")
        return Normalizer(self.scale, self.mean, self.std)
