"""Train a segmentation network on halo tiles, then predict the held-out scenes whole.

Run it::

    seg-train                                   # synthetic data, small U-Net, ~5 min on 2 CPU cores
    seg-train model=unet_tiny tiling=grid tiling.q=2 trainer.max_epochs=5
    seg-train experiment=unet2015 logger=csv
    seg-train -m tiling.q=1,2,4 tiling=grid     # Hydra multirun sweep
    seg-train -m hparams_search=lr_sweep

An interrupted run resumes from its last checkpoint: rerun the same command with
``hydra.run.dir=<the run's folder>``. SIGTERM and Ctrl+C stop training with a checkpoint
saved; a run folder is never rewritten with another config (:mod:`seg_at_scale.cli.runs`);
every split's files are checked before the first step (:mod:`seg_at_scale.data.preflight`).

This module is the entry point alone: the checks that need no data and no network (the
model's bands against the data's, a weights hub name on an offline machine) run before
Lightning is imported, so their refusals come in seconds; the run itself is
:mod:`seg_at_scale.cli.training`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from seg_at_scale.cli.common import USER_ERROR_EXIT, long_lived, reports_errors, tidy_refused_run
from seg_at_scale.cli.overrides import TRAIN_CONFIG_DIR, compose_train
from seg_at_scale.config_check import nearest, unset_keys
from seg_at_scale.errors import ConfigError

__all__ = ["main", "check_added_keys", "check_unset", "check_numbers", "check_epochs",
           "check_sweep", "check_model_bands", "check_hub_weights", "CONFIG_DIR"]

CONFIG_DIR = str(TRAIN_CONFIG_DIR)  # shipped in the wheel
WEIGHT_KEYS = ("encoder_weights", "weights", "backbone_weights")  # model keys naming weights


def check_added_keys(cfg: DictConfig, added: list[str], groups: list[str]) -> None:
    """Refuse a top-level key added with ``+`` (``+modl=unet_tiny``) that nothing reads.

    Hydra answers a mistyped key (``modl=unet_tiny``) with "To append to your config use
    +modl=unet_tiny"; taken, the run trained the default model without a word. Keys below
    a group (``+model.x``, ``+trainer.x``) are the group's checks' to refuse.

    Args:
        cfg: the composed config.
        added: the command line's ``+`` overrides (``+key=value``; not ``++``, which sets an
            existing key as well as it adds one).
        groups: the config groups (Hydra's choices: ``model``, ``experiment``, ...).
    """
    paths = [o[1:].split("=", 1)[0].split(".") for o in added]
    below: dict[str, set[str]] = {}  # top-level key -> its keys added with + (+key.x=...)
    for path in paths:
        below.setdefault(path[0], set()).update(path[1:2])
    made = {top for top, keys in below.items()  # by the + overrides alone: no other key
            if not keys or (isinstance(cfg.get(top), DictConfig) and set(cfg[top]) <= keys)}
    group_names = {g for g in groups if "/" not in g and "@" not in g}
    known = sorted((set(cfg) - made) | group_names)
    for key in sorted(made - set(known)):
        near = nearest(key, known)
        hint = f" (did you mean {near}=?)" if near else ""
        raise ConfigError(f"+{key}= adds a key that no part of seg-train reads{hint}; the "
                          f"top-level keys and groups are {', '.join(known)}")


#: What to give for a key a group leaves to the user (``???``).
_UNSET_HINTS = {"data.root": "<the folder of your train/ val/ test/ splits>",
                "data.bands": "<the images' band count>",
                "data.num_classes": "<the classes in the masks: labels 0..K-1>",
                "pipeline.balance": "<the layers of each stage, e.g. [14,24]>"}


def check_unset(cfg: DictConfig, choices: dict[str, str | None]) -> None:
    """Refuse a run whose config still holds a ``???`` the user must set, naming them all.

    ``seg-train data=tiff data.root=mine`` without ``data.bands`` ended in omegaconf's
    traceback ("Missing mandatory value: data.bands"); refused here in one line that lists
    every key to add, with what to put there (the training images' band count when
    ``data.root`` already names readable scenes).
    """
    unset = unset_keys(cfg)
    if not unset:
        return
    hints = dict(_UNSET_HINTS)
    if "data.bands" in unset:
        bands = _training_bands(cfg)
        if bands is not None:
            hints["data.bands"] = f"{bands}"
    groups = sorted({k.split(".", 1)[0] for k in unset if "." in k})
    chosen = ", ".join(f"{g}={choices[g]}" for g in groups if choices.get(g))
    which = f" ({chosen} leaves {'it' if len(unset) == 1 else 'them'} to you)" if chosen else ""
    named = unset[0] if len(unset) == 1 else f"{', '.join(unset[:-1])} and {unset[-1]}"
    raise ConfigError(f"{named} {'has' if len(unset) == 1 else 'have'} no value{which}; add "
                      + " ".join(f"{k}={hints.get(k, '<value>')}" for k in unset))


def _training_bands(cfg: DictConfig) -> int | None:
    """The band count of the first training image under ``data.root``, if one is readable."""
    from omegaconf import OmegaConf

    if OmegaConf.is_missing(cfg.data, "root"):
        return None
    try:
        from seg_at_scale.data.scenes import find_scenes
        from seg_at_scale.io import RasterReader

        with RasterReader(find_scenes(Path(str(cfg.data.root)) / "train")[0].image) as image:
            return image.bands
    except Exception:  # noqa: BLE001 - a hint only: the preflight names what is wrong
        return None


#: Numbers of the run that torch and Lightning take unchecked: (key, smallest, kind).
#: ``seed=abc`` ended in int()'s traceback, ``task.optimizer.lr=-1`` in torch's, after
#: Lightning had started and the run folder was written.
_NUMBERS = (("seed", None, int), ("task.optimizer.lr", 0.0, float),
            ("task.optimizer.weight_decay", 0.0, float), ("task.optimizer.momentum", 0.0, float))


def check_numbers(cfg: DictConfig) -> None:
    """Refuse numbers torch and Lightning would take unchecked, naming key, value and fix.

    A seed that is not a whole number, a learning rate not above 0, a negative weight
    decay or momentum.
    """
    from omegaconf import OmegaConf

    for key, low, kind in _NUMBERS:
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if value is None:
            continue
        whole = kind is int
        ok = isinstance(value, int | float) and not isinstance(value, bool) and (
            not whole or float(value).is_integer())
        if not ok:
            raise ConfigError(f"{key}={value!r} is not a {'whole number' if whole else 'number'}"
                              f"; give e.g. {key}={_EXAMPLES[key]}")
        if low is not None and (value <= low if key.endswith(".lr") else value < low):
            bound = "above 0" if key.endswith(".lr") else "0 or more"
            raise ConfigError(f"{key}={value} must be {bound}; give e.g. {key}={_EXAMPLES[key]}")


def check_epochs(cfg: DictConfig) -> None:
    """Refuse ``trainer.max_epochs`` that trains nothing or never ends.

    ``0`` predicted the test scenes with untrained weights and saved no checkpoint; ``-1``
    (Lightning's "no limit") without ``max_steps`` or ``max_time`` trained until killed.
    """
    from omegaconf import OmegaConf

    epochs = OmegaConf.select(cfg, "trainer.max_epochs", default=None)
    if epochs is None or isinstance(epochs, bool) or not isinstance(epochs, int):
        return  # Lightning's type check says the rest
    steps = OmegaConf.select(cfg, "trainer.max_steps", default=None)
    limited = (isinstance(steps, int) and steps > 0) or \
        OmegaConf.select(cfg, "trainer.max_time", default=None) is not None
    if epochs == 0 or epochs < -1 or (epochs == -1 and not limited):
        what = ("trains nothing" if epochs == 0 else "never ends: give trainer.max_steps or "
                "trainer.max_time with it" if epochs == -1 else "is not an epoch count")
        raise ConfigError(f"trainer.max_epochs={epochs} {what}; give e.g. trainer.max_epochs=12")


def check_sweep(argv: list[str]) -> None:
    """Every value of a ``-m`` sweep's keys, checked before its first trial runs.

    ``-m tiling.batch_size=2,0,4`` trained trial 0 to the end, then stopped the sweep on
    trial 1's refusal. The config is composed once (each group at its first value); each
    listed value of a key below a group, or of a top-level number, is then checked as its
    trial would check it (the ``data`` and ``tiling`` groups, the numbers of
    :func:`check_numbers` and :func:`check_epochs`). Optuna's ranges are drawn later and
    not checked here; neither are values Hydra cannot compose (Hydra says so itself).
    """
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from seg_at_scale.data.config import data_config, tiling_config

    try:
        flags, _ = get_args_parser().parse_known_args(argv)
        overrides = OverridesParser.create().parse_overrides(list(flags.overrides))
    except (SystemExit, Exception):  # noqa: BLE001 - what Hydra cannot read, it says
        return
    if not flags.multirun or flags.config_dir or flags.config_path:
        return
    base, swept = [], []
    for o in overrides:
        if not o.is_sweep_override():
            base.append(o.input_line)
        elif not o.is_discrete_sweep():
            return  # a range an optimiser draws from
        else:
            values = list(o.sweep_iterator())
            base.append(f"{o.get_key_element()}={values[0]}" if values else o.input_line)
            if "." in o.key_or_group or o.key_or_group == "seed":
                swept.append((o.key_or_group, values))
    if not swept:
        return
    cfg = compose_train([b for b in base if b is not None])
    if cfg is None:
        return  # Hydra's to say, at the trial
    for key, values in swept:
        for value in values:
            trial = cfg.copy()
            try:
                OmegaConf.update(trial, key, value, force_add=True)
                group = key.split(".")[0]
                if group in ("data", "tiling"):
                    check = data_config if group == "data" else tiling_config
                    check(OmegaConf.to_container(trial[group], resolve=True))  # type: ignore[arg-type]
                check_numbers(trial)
                check_epochs(trial)
            except ConfigError as exc:
                shown = ",".join(str(v) for v in values)
                raise ConfigError(f"the sweep's {key}={shown}: {exc} (the trial of {key}="
                                  f"{value}); no trial was run") from None
            except Exception:  # noqa: BLE001 - what only the trial can resolve: its own
                return


_EXAMPLES = {"seed": "0", "task.optimizer.lr": "0.001", "task.optimizer.weight_decay": "0.0001",
             "task.optimizer.momentum": "0.9"}


def check_model_bands(cfg: DictConfig) -> None:
    """The model reads the data's bands: ``model.in_channels`` (``model.planes``) is ``data.bands``.

    ``model.in_channels=3`` on 4-band data passed every check and died in the first step
    with torch's "expected input[8, 4, 256, 256] to have 3 channels"; refused here, before
    any work, naming both values and the fixes (the band map, for 3-band weights).
    """
    bands = cfg.data.get("bands")
    for key in ("in_channels", "planes"):
        given = cfg.model.get(key) if key in cfg.model else None
        if not (isinstance(bands, int) and isinstance(given, int)) or isinstance(
                bands, bool) or isinstance(given, bool):
            continue  # absent, or a bad value data.bands' own check names
        if given != bands:
            example = ",".join(str(i) if i < given else "null" for i in range(bands))
            mapped = (f"; to start from {given}-band pretrained weights keep model.{key}="
                      f"{bands} and map the bands onto their channels with model.band_map "
                      f"(e.g. model.band_map=[{example}])" if "band_map" in cfg.model else "")
            raise ConfigError(f"model.{key}={given} but data.bands={bands}: the network would "
                              f"read {bands}-band tiles with a first layer for {given}; set "
                              f"model.{key}={bands} (or leave it out: it follows data.bands)"
                              f"{mapped}; or set data.bands to the images' bands")


def check_planes(cfg: DictConfig, choices: dict[str, str | None]) -> None:
    """A network of detector planes trains with the task that scores them, and only it.

    A model key ``planes`` (UResNet's) goes with ``task=cosmic`` and one label band per
    plane. Any other pairing failed after its first steps (the 4 bands of ``data=synthetic`` taken
    as 4 planes, scored as 20 classes by ``task=segmentation``), or trained a U-Net's logits
    cut into planes by ``task=cosmic``.
    """
    model, task = choices.get("model"), choices.get("task")
    planes, scored = cfg.model.get("planes"), "planes" in cfg.task
    if planes is not None and not scored:
        raise ConfigError(f"model={model} labels each detector plane (model.planes) apart, "
                          f"which task={task} does not score; use task=cosmic with data of "
                          "one label band per plane (data=cosmic, or data.mask_bands=<planes>)")
    if scored and planes is None:
        raise ConfigError(f"task={task} scores detector planes apart, which model={model} "
                          "does not label; use model=uresnet_* (or another task)")
    masks = cfg.data.get("mask_bands", 1)
    if scored and isinstance(planes, int) and masks != planes:
        raise ConfigError(f"model={model} labels {planes} planes (model.planes) but the data "
                          f"has {masks} label band(s) per scene (data.mask_bands); give one "
                          f"label band per plane (data.mask_bands={planes}, data=cosmic)")
    if planes is not None and cfg.get("predict_after_fit"):
        # refused after the whole training before: the test scenes are predicted to a COG
        raise ConfigError(f"model={model} labels {planes} detector planes apart, and the "
                          "prediction after training writes one label per pixel; pass "
                          "predict_after_fit=false, and predict the planes in Python "
                          "(docs/models.md, \"UResNet and the CosmicTagger data\")")


def check_model_classes(cfg: DictConfig) -> None:
    """The model predicts the data's classes: ``model.num_classes`` is ``data.num_classes``.

    Another value failed in the first step (a target beyond the logits: "Target 3 is out of
    bounds") or after the first epoch, in the metrics; refused here, naming both.
    """
    classes, given = cfg.data.get("num_classes"), cfg.model.get("num_classes")
    if not (isinstance(classes, int) and isinstance(given, int)) or isinstance(
            classes, bool) or isinstance(given, bool) or given == classes:
        return
    raise ConfigError(f"model.num_classes={given} but data.num_classes={classes}: the network "
                      f"would give {given} logits per pixel for labels of {classes} classes; "
                      f"set model.num_classes={classes} (or leave it out: it follows "
                      "data.num_classes), or data.num_classes to the masks' classes")


def check_hub_weights(model: DictConfig) -> None:
    """Refuse a weights hub name this machine cannot fetch, before any work.

    Offline (``HF_HUB_OFFLINE=1``, or the hub silent for
    :data:`~seg_at_scale.models.weights.HUB_TIMEOUT_S`) with the weights not in the local
    Hugging Face cache: one line naming the key and the download to do, in seconds, not
    after the scenes are written and the model built (the decision is made once, here).
    """
    specs = {key: model.get(key) for key in WEIGHT_KEYS}
    if not any(isinstance(spec, str) for spec in specs.values()):
        return  # nothing to look up: no torch import for the common case
    from seg_at_scale.models.weights import check_hub_name

    encoder = model.get("encoder") or (f"tu-{model.backbone}" if model.get("backbone")
                                       else "")
    for key, spec in specs.items():
        if isinstance(spec, str):
            check_hub_name(spec, str(encoder), key=f"model.{key}")


def main() -> float | None:
    """``seg-train``: its arguments read first (:func:`~.overrides.precheck`), then Hydra's app.

    A mistyped key (``modl=unet_tiny``) is named with the nearest one before Hydra, whose
    answer is to append it (``+modl=unet_tiny``); the quoting a value needs is said too.
    """
    from seg_at_scale.cli.overrides import precheck, train_top_keys

    if not any(a in ("--help", "-h", "--hydra-help") for a in sys.argv[1:]):
        precheck("seg-train", None, top=train_top_keys())
        try:
            check_sweep(sys.argv[1:])
        except ConfigError as exc:
            print(f"seg-train: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(USER_ERROR_EXIT) from None
    try:
        return _main()
    finally:  # a multirun a failed trial ended still reports the trials it ran
        report = sys.modules.get("seg_at_scale.sweeps.report")  # loaded by its callback
        if report is not None:
            report.report_unended_multiruns()


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
@reports_errors("seg-train")
def _main(cfg: DictConfig) -> float | None:
    """Train, validate, predict the test scenes; returns ``val/miou`` for sweeps."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    with tidy_refused_run():  # a refusal leaves no empty run folder
        check_added_keys(cfg, [o for o in hydra_cfg.overrides.task
                               if o.startswith("+") and not o.startswith("++")],
                         list(hydra_cfg.runtime.choices))
        check_unset(cfg, dict(hydra_cfg.runtime.choices))  # every ??? named, in one line
        check_numbers(cfg)
        check_epochs(cfg)
        check_model_bands(cfg)  # before any work: nothing written, nothing built
        check_planes(cfg, dict(hydra_cfg.runtime.choices))
        check_model_classes(cfg)
        check_hub_weights(cfg.model)  # offline with a hub name: refused in seconds
        with long_lived():
            from seg_at_scale.cli import training  # Lightning and the network stack: now

        return training.run(cfg)


if __name__ == "__main__":
    main()
