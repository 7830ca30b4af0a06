"""One source of option truth: ``PredictJob`` and ``PredictOptions`` hold every
``seg-predict`` key, its default and its meaning; ``predict.yaml`` holds the same values,
``--help`` is made from them, and ``train.yaml``'s ``predict:`` block goes through them."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
from helpers.cli import run_here
from omegaconf import OmegaConf

from seg_at_scale.cli.predict import PredictJob, help_text, main
from seg_at_scale.prediction.options import PredictOptions, field_docs

CONF = Path(__file__).resolve().parents[2] / "seg_at_scale" / "conf_predict" / "predict.yaml"


def _defaults() -> dict[str, object]:
    job = {f.name: f.default for f in fields(PredictJob) if f.name != "options"}
    return {**job, **{k: getattr(PredictOptions(), k) for k in PredictOptions.names()}}


def test_predict_yaml_holds_the_dataclasses_keys_and_defaults():
    doc = OmegaConf.to_container(OmegaConf.load(CONF))
    assert isinstance(doc, dict)
    yaml = {k: v for k, v in doc.items() if k not in ("defaults", "hydra")}
    defaults = _defaults()
    assert sorted(yaml) == sorted(defaults)
    differ = {k: (yaml[k], defaults[k]) for k in yaml
              if (tuple(yaml[k]) if isinstance(yaml[k], list) else yaml[k]) != defaults[k]}
    assert differ == {}  # was: fast true in the YAML, False in PredictOptions


def test_every_key_is_documented_once_and_help_is_made_from_it():
    docs = {**field_docs(PredictJob), **PredictOptions.docs()}
    assert sorted(docs) == sorted(_defaults())
    text = help_text()
    for key, default in _defaults().items():
        shown = "" if default is None else str(default).lower() if isinstance(default, bool) \
            else str(default)
        assert f"  {key}={shown} " in text or f"  {key}={shown}\n" in text, key
    res = run_here(main, ["seg-predict", "--help"])
    assert res.returncode == 0 and res.stdout.strip() == text.strip()


def test_the_training_predict_block_goes_through_the_options():
    from seg_at_scale.cli.training import predict_options
    from seg_at_scale.errors import ConfigError

    cfg = OmegaConf.create({"predict": {"tile_size": 512, "fast": False, "tta": "flips"},
                            "data": {"nodata": 0}})
    opts = predict_options(cfg)
    assert (opts.tile_size, opts.fast, opts.tta, opts.nodata, opts.overwrite) == \
        (512, False, "flips", 0.0, True)
    cfg.predict.tile_size = "abc"
    with pytest.raises(ConfigError, match=r"^predict\.tile_size='abc'"):
        predict_options(cfg)
    cfg.predict.tile_size = 512
    cfg.predict.tile_sise = 5
    with pytest.raises(ConfigError, match=r"predict\..*tile_sise.*tile_size"):
        predict_options(cfg)
