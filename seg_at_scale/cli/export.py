"""Export a training run as a portable model file: ``seg-export run=<folder> output=m.segmodel``.

Run it::

    seg-export run=runs/same_unet_small/<date> output=unet_small.segmodel
    seg-export run=runs/same_unet_small/<date> output=models/unet_small ckpt=last
    seg-predict model=unet_small.segmodel image=scene.tif output=scene_mask.tif

The file holds what prediction needs and nothing else (:mod:`seg_at_scale.models.segmodel`):
weights as safetensors, a JSON card, the SHA-256 of each part. Exporting reads the run the
way ``seg-predict`` does: the model from the registry, the checkpoint as plain data.
"""

from __future__ import annotations

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig

from seg_at_scale.cli.common import reports_errors
from seg_at_scale.config_check import check_local, check_types, known_keys, resolved
from seg_at_scale.errors import ConfigError, OutputExistsError
from seg_at_scale.models.loading import model_files
from seg_at_scale.models.segmodel import CARD, SUFFIX, SUMS, write_model
from seg_at_scale.models.trained import load_run
from seg_at_scale.prediction.checks import check_outputs

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "conf_predict")  # shipped in the wheel
KEYS = {"run": str, "ckpt": str, "output": str, "overwrite": bool, "trust_run": bool}


def export(cfg: DictConfig) -> dict[str, object]:
    """Check the keys, read the run, write the model; what was written."""
    values = resolved(cfg)
    known_keys("", values, list(KEYS))
    for key in ("run", "output"):
        if not values.get(key):
            raise ConfigError(f"{key}= is missing: give seg-export {key}=<path> (see "
                              "seg-export --help)")
    check_types("", values, KEYS)
    for key in ("run", "output"):
        check_local(f"{key}='{values[key]}'", str(values[key]), output=key == "output")
    run, output = Path(values["run"]), Path(values["output"])
    overwrite = bool(values["overwrite"])
    if output.suffix != SUFFIX and output.is_dir():  # the folder form, exported before
        _check_model_folder(output, overwrite)
    else:
        check_outputs({"output": output}, model_files(run, None, values["ckpt"]),
                      overwrite=overwrite)
        if output.suffix != SUFFIX and output.is_file():
            raise ConfigError(f"output '{output}' is a file, and seg-export writes a folder "
                              f"for a name without {SUFFIX}; name the output <name>{SUFFIX} "
                              "for one file, or choose another path")
    trained = load_run(run, values["ckpt"], trust=bool(values["trust_run"]))
    path = write_model(trained, output, overwrite=bool(values["overwrite"]))
    return {"model": str(path), "from": trained.source, "checkpoint": str(trained.checkpoint),
            "family": trained.card.family,
            "footprint": trained.card.raw["footprint"], "metrics": trained.card.metrics}


def _check_model_folder(output: Path, overwrite: bool) -> None:
    """An existing folder output is replaced only if seg-export wrote it, with overwrite."""
    if not all((output / part).is_file() for part in (CARD, SUMS)):
        raise ConfigError(f"output '{output}' is a folder seg-export did not write; choose "
                          "another path (overwrite=true replaces only a model seg-export wrote)")
    if not overwrite:
        raise OutputExistsError(f"output '{output}' is a model seg-export wrote; pass "
                                "overwrite=true to replace it (or choose another path)")


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="export")
@reports_errors("seg-export")
def _main(cfg: DictConfig) -> None:
    print(json.dumps(export(cfg), indent=2))


def main() -> None:
    """Console entry point ``seg-export``."""
    from seg_at_scale.cli.overrides import precheck

    precheck("seg-export", "export")
    _main()


if __name__ == "__main__":
    main()
