"""The typed model card: read once from the card's data, written back unchanged, its
normalisation refused in one line naming the value as written."""

from __future__ import annotations

import copy
import json

import pytest

from seg_at_scale.errors import InputError
from seg_at_scale.models.card import ModelCard

CARD = {"format": "seg_at_scale.model/1", "model": {"family": "unet", "in_channels": 4,
                                                     "num_classes": 3, "levels": 3},
        "footprint": {"halo": 44, "align": 8, "padding": "valid", "out_residue": 4},
        "exact": False,
        "data": {"bands": 4, "num_classes": 3, "class_names": ["bg", "road", "roof"],
                 "colours": [[0, 0, 0], [255, 0, 0], [0, 255, 0]], "ignore_index": 255,
                 "normalization": {"scale": 0.00392, "mean": [0.5, 0.4, 0.3, 0.2],
                                   "std": [0.25, 0.25, 0.2, 0.2]},
                 "input": {"dtype": "uint8", "high": 231.0}},
        "metrics": {"val/miou": 0.91}}


def test_every_field_is_read_once_and_the_raw_card_is_kept():
    card = ModelCard.of(CARD)
    assert (card.family, card.model["levels"], card.exact) == ("unet", 3, False)
    fp = card.footprint
    assert (fp.halo, fp.align, fp.padding, fp.out_residue) == (44, 8, "valid", 4)
    assert (card.bands, card.num_classes, card.ignore_index) == (4, 3, 255)
    assert card.class_names == ("bg", "road", "roof") and card.colours[1] == (255, 0, 0)
    assert card.input == {"dtype": "uint8", "high": 231.0}
    assert card.metrics == {"val/miou": 0.91}
    norm = card.normalizer("model 'm'")
    assert norm.std == (0.25, 0.25, 0.2, 0.2) and norm.scale == pytest.approx(0.00392)
    assert json.dumps(card.raw, sort_keys=True) == json.dumps(CARD, sort_keys=True)
    assert "family" not in card.model  # the node the registry builds from


def test_missing_names_default_and_exact_defaults_true():
    doc = copy.deepcopy(CARD)
    del doc["exact"], doc["data"]["class_names"], doc["data"]["colours"]
    card = ModelCard.of(doc)
    assert card.exact and card.class_names == ("class_0", "class_1", "class_2")
    assert card.colours is None


@pytest.mark.parametrize(("key", "value", "said"), [("std", [0.25, 0, 0.2, 0.2],
                                                       "std 0 for band 1"),
                                                      ("scale", -1, "scale -1")])
def test_a_normalisation_that_does_not_divide_is_refused_naming_it(key, value, said):
    doc = copy.deepcopy(CARD)
    doc["data"]["normalization"][key] = value
    with pytest.raises(InputError, match=f"model 'm': the normalisation has {said}, which "
                                         "must be > 0"):
        ModelCard.of(doc).normalizer("model 'm'")
