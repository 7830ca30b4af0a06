"""The training run behind ``seg-train`` (:mod:`seg_at_scale.cli.train`).

Scenes, model, memory, pipeline, Lightning's Trainer, then the held-out scenes predicted
whole.

Imported by the entry point only after its cheap checks (bands, hub names) have passed, so
that a refusal does not wait on importing Lightning.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import signal
import threading
import typing
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import psutil
import pytorch_lightning as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint

from seg_at_scale.cli.common import class_names_of, format_iou
from seg_at_scale.cli.data_setup import (
    check_grids,
    checked_groups,
    record_training_data,
    resolve_normalization,
    run_preflight,
    synthesize,
)
from seg_at_scale.cli.malloc import allocator
from seg_at_scale.cli.pretrained import run_footprint, use_weights_normalization
from seg_at_scale.cli.runs import RunFolder, global_rank, run_lock
from seg_at_scale.config_check import check_types, known_keys, resolved
from seg_at_scale.data.datamodule import TileDataModule
from seg_at_scale.errors import ConfigError, SegAtScaleError
from seg_at_scale.io import RasterReader
from seg_at_scale.memory import (
    MemoryConfig,
    MemoryReport,
    apply_memory_mode,
    auto_tile,
    check_precision,
    covering_side,
    memory_config,
    pipe_checkpoint_mode,
)
from seg_at_scale.models.card import ModelCard
from seg_at_scale.models.checkpoint import TRAIN_CHOICE, load_checkpoint
from seg_at_scale.models.registry import build_model, predicting
from seg_at_scale.models.trained import (
    MEANING_KEY,
    RUN_CONFIG,
    TrainedModel,
    card_of_config,
    prediction_footprint,
    read_run_config,
    weights_meaning,
)
from seg_at_scale.parallel.environment import plain_environment, quiet_srun_hint
from seg_at_scale.parallel.launch import group_of_its_own
from seg_at_scale.parallel.pipe import PipelineConfig, close_live_pipes
from seg_at_scale.parallel.setup import (
    pipeline_group,
    pipeline_strategy,
    resolve_pipeline,
    setup_pipeline,
)
from seg_at_scale.prediction.options import PredictOptions
from seg_at_scale.prediction.scene import predict_scene
from seg_at_scale.tasks.finetune import check_finetune_values, freeze_batch_norm
from seg_at_scale.tasks.interrupt import (
    SaveOnStop,
    SIGTERMException,
    newest_checkpoint,
    slurm_plugins,
)
from seg_at_scale.tasks.loggers import own_tracker_run
from seg_at_scale.tasks.progress import EpochLines, ModelTable, bar_is_seen
from seg_at_scale.tiling import make_grid

log = logging.getLogger("seg_at_scale.train")


def computed_values(dm: TileDataModule, fp: Any, cfg: DictConfig) -> dict[str, Any]:
    """Halo, alignment and efficiency E of the validation grid: saved with the run."""
    scene = dm.scenes_of("val")[0]
    with RasterReader(scene.image) as r:
        grid = make_grid(r.height, r.width, fp, q=cfg.tiling.q, tile_size=cfg.tiling.tile_size)
        size = [r.height, r.width]
    return {"halo": fp.halo, "context": fp.context, "align": fp.align, "padding": fp.padding,
            "out_residue": fp.out_residue, "grid": list(grid.shape), "scene_size": size,
            "efficiency": round(grid.efficiency, 4)}


def resolve_ckpt(cfg: DictConfig, run: RunFolder) -> str | None:
    """Checkpoint to resume from, checked before anything is written.

    ``auto``: the run folder's newest checkpoint that loads (last.ckpt, the best ones,
    hpc_ckpt); none for a new run. A folder that holds a run but no usable checkpoint is
    refused, naming what is missing (training it again from scratch while logging
    "resuming" would replace its checkpoints). A path is loaded to check it.
    """
    trust = bool(cfg.get("trust_run", False))
    if cfg.ckpt_path in (None, "none"):
        return None
    if cfg.ckpt_path != "auto":
        ckpt = load_checkpoint(Path(cfg.ckpt_path), trust=trust, choice=TRAIN_CHOICE)
        if not run.resuming:
            check_left_to_train(ckpt, cfg)
        return str(cfg.ckpt_path)
    newest = newest_checkpoint(run.path, trust=trust)
    # DDP ranks other than 0 start after rank 0 saved the run's config: a "resume" to them
    if newest is None and run.resuming and global_rank() == 0:
        raise ConfigError(
            f"hydra.run.dir='{run.path}' holds a run ({RUN_CONFIG}) but no checkpoint to "
            f"resume from ({run.path / 'checkpoints'} has no .ckpt: deleted, or the run was "
            "stopped before its first one); to train it again from the start in this folder "
            "pass ckpt_path=none, or start a new run (leave out hydra.run.dir)")
    return str(newest) if newest else None


def warn_training_norms(model: torch.nn.Module, cfg: DictConfig, freeze_bn: str) -> None:
    """Warn that BatchNorms that train make a grid step other than the whole image's.

    ``tiling=grid`` promises the gradient of the whole image's loss; a BatchNorm in
    training mode normalises each tile with that tile's statistics instead.
    """
    if OmegaConf.select(cfg, "tiling.mode") != "grid":
        return
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    frozen = freeze_batch_norm(model, freeze_bn)  # what fit keeps in eval mode
    if len(norms) > frozen:
        log.warning("%d BatchNorm layers train (finetune.freeze_bn=%s): each grid tile is "
                    "normalised with its own statistics, so a step is not the whole image's "
                    "exact gradient; use finetune.freeze_bn=all (the statistics the model "
                    "has), or model.norm=group", len(norms) - frozen, freeze_bn)


def check_monitor(cfg: DictConfig) -> None:
    """Refuse a checkpoint monitor that names a logged metric in another case.

    ``monitor=val/mIoU`` failed in Lightning after the first training epoch ("could not
    find the monitored key"); the metrics are lower case: ``val/miou``, ``val/loss``,
    ``val/iou_<class>``.
    """
    monitor = OmegaConf.select(cfg, "callbacks.model_checkpoint.monitor", default=None)
    if not isinstance(monitor, str):
        return
    logged = ["val/miou", "val/loss", "train/loss",
              *(f"val/iou_{n}" for n in class_names_of(cfg.data))]
    close = [name for name in logged if name.lower() == monitor.lower() and name != monitor]
    if close:
        raise ConfigError(f"callbacks.model_checkpoint.monitor={monitor!r} is not a metric the "
                          f"run logs; did you mean {close[0]!r}? (val/miou, val/loss, "
                          "val/iou_<class>)")


def check_left_to_train(ckpt: dict[str, Any], cfg: DictConfig) -> None:
    """Refuse a new run from a checkpoint that has trained ``trainer.max_epochs`` already.

    Lightning restored it and stopped at once: the new run trained nothing, saved no
    checkpoint and reported the other run's ``val/miou`` and checkpoint as its own.
    """
    progress = ckpt.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {})
    done = progress.get("current", {}).get("processed") if isinstance(progress, dict) else None
    epochs = OmegaConf.select(cfg, "trainer.max_epochs", default=None)
    if isinstance(done, int) and isinstance(epochs, int) and 0 <= epochs <= done:
        raise ConfigError(f"ckpt_path='{cfg.ckpt_path}' has trained {done} epoch"
                          f"{'s' if done != 1 else ''}, and "
                          f"trainer.max_epochs={epochs}: nothing is left to train from it (the "
                          "run would report that run's figures as its own); raise "
                          f"trainer.max_epochs above {done}, or continue that run in its own "
                          "folder")


def predict_options(cfg: DictConfig) -> PredictOptions:
    """``train.yaml``'s ``predict:`` block as :class:`PredictOptions` (any of its keys).

    The run's own outputs are replaced on a resume (``overwrite``), quietly (``progress``),
    and no data is the data group's (``data.nodata``). Checked before any work.

    Raises:
        ConfigError: ``predict.<key>`` unknown or of a bad value, named.
    """
    block = OmegaConf.to_container(cfg.predict, resolve=True) if cfg.get("predict") else {}
    assert isinstance(block, dict)
    nodata = cfg.data.get("nodata")
    if nodata is not None and (isinstance(nodata, bool) or not isinstance(nodata, int | float)):
        raise ConfigError(f"data.nodata={nodata!r}: give the images' no-data value, nan, or "
                          "null")  # as the data group says it, which is checked after this
    try:
        return PredictOptions.from_mapping({
            **{str(k): v for k, v in block.items()}, "overwrite": True, "progress": False,
            "nodata": None if nodata is None else float(nodata)})
    except ConfigError as exc:  # its messages start with the key
        raise ConfigError(f"predict.{exc}") from None


def predict_test(cfg: DictConfig, task: Any, dm: TileDataModule, fp: Any, out_dir: Path,
                 loggers: list[Any]) -> list[dict[str, Any]]:
    """Predict each test scene whole (streaming, tiled) and score it against its mask."""
    results = []
    fp = prediction_footprint(task.model, cfg.tiling)  # exact, whatever the training halo
    trained = TrainedModel(task.model, ModelCard.of(card_of_config(cfg, fp)),
                           f"run '{out_dir}'", cfg)
    options = predict_options(cfg)
    for scene in dm.scenes_of("test"):
        with predicting(task.model, resolved(cfg.model)):  # Gated-SCNN: its classes' logits
            res = predict_scene(trained, scene.image,
                                out_dir / "predictions" / f"{scene.name}_pred.tif", options,
                                mask=scene.mask)
        results.append(res)
        for lg in loggers:
            if hasattr(lg, "log_image") and "preview" in res:
                lg.log_image(key=f"test/{scene.name}", images=[res["preview"]])
            lg.log_metrics({"test/miou": res["miou"]})
        log.info("test scene %s:\n%s", scene.name, format_iou(res, class_names_of(cfg.data)))
    return results


def check_trainer(cfg: DictConfig) -> None:
    """The ``trainer`` group's plain keys against ``pl.Trainer``'s parameters and types.

    ``trainer.max_epochs=abc`` failed deep in the scheduler's step count with a
    ``ValueError``; it is refused here naming the key and the type.
    """
    values = resolved(cfg.trainer)
    plain = {k: v for k, v in values.items()
             if not str(k).startswith("_") and not (isinstance(v, dict) and "_target_" in v)}
    params = [k for k in inspect.signature(pl.Trainer.__init__).parameters if k != "self"]
    known_keys("trainer", plain, params)
    check_types("trainer", plain, typing.get_type_hints(pl.Trainer.__init__))
    check_devices(str(plain.get("accelerator", "auto")), plain.get("devices", "auto"))
    check_processes(plain, values.get("strategy"))


def check_processes(plain: dict[str, Any], strategy: Any) -> None:
    """Refuse several processes without the project's sample parallelism (``trainer=ddp``).

    The DataModule gives each rank its share of every image's tiles; Lightning's own DDP
    (``trainer.devices=2`` on the default trainer) split those shares again through its
    sampler, trained on 1/N of the data, validated on part of the tiles and exited 0.
    """
    target = strategy.get("_target_", "") if isinstance(strategy, dict) else ""
    if str(target).endswith("SampleParallelStrategy"):
        return
    count = process_count(plain)
    if count > 1:
        raise ConfigError(f"trainer.devices={plain.get('devices', 'auto')} (trainer.num_nodes="
                          f"{plain.get('num_nodes', 1)}) runs {count} processes, "
                          "which train by sample parallelism: add trainer=ddp (each process "
                          "takes its share of every image's tiles and the gradients are "
                          "summed per image)")


def process_count(plain: dict[str, Any]) -> int:
    """The training processes the ``trainer`` group's devices and nodes start."""
    devices, nodes = plain.get("devices", "auto"), plain.get("num_nodes", 1)
    gpus = torch.cuda.device_count() if str(plain.get("accelerator", "auto")) in (
        "auto", "gpu", "cuda") and torch.cuda.is_available() else 1
    count = (len(devices) if isinstance(devices, list) else
             gpus if devices in ("auto", -1, "-1") else
             int(devices) if str(devices).isdigit() else 1)
    return count * (nodes if isinstance(nodes, int) and nodes > 0 else 1)


def build_trainer(group: DictConfig, **kwargs: Any) -> pl.Trainer:
    """``pl.Trainer`` of the ``trainer`` group; what Lightning refuses, said in one line.

    Lightning checks the combination of accelerator, strategy, devices and precision when
    the trainer is made; its ``MisconfigurationException`` (or ``ValueError``: an unknown
    strategy name) came through Hydra's wrapping as four lines and a traceback hint.
    """
    from hydra.errors import InstantiationException
    from lightning_fabric.utilities.exceptions import MisconfigurationException

    try:
        return cast(pl.Trainer, instantiate(group, **kwargs))
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, MisconfigurationException | ValueError):
            said = " ".join(str(cause).split())
            raise ConfigError(f"the trainer group: Lightning says: {said} (check trainer.* "
                              "on the command line or conf/trainer/)") from None
        raise


def check_devices(accelerator: str, devices: Any) -> None:
    """Refuse a GPU run on a machine whose torch sees no GPU, or fewer than asked for.

    ``trainer=gpu`` on a CPU machine failed after the preflight, with the run folder
    written, in Hydra's four-line wrapping of Lightning's "No supported gpu backend found!".
    """
    if accelerator not in ("gpu", "cuda"):
        return  # auto picks what there is; cpu always runs; others are Lightning's to check
    mps = accelerator == "gpu" and torch.backends.mps.is_available()
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0 and not mps:
        raise ConfigError(f"trainer.accelerator={accelerator} but torch sees no GPU (torch "
                          f"{torch.__version__}, CUDA {torch.version.cuda or 'not built in'}, "
                          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                          "train on the CPU with trainer=default, or run where a GPU is")
    ids = devices if isinstance(devices, list) else None
    count = devices if isinstance(devices, int) and not isinstance(devices, bool) else None
    if have and ((count is not None and count > have) or (ids and max(ids) >= have)):
        raise ConfigError(f"trainer.devices={devices} but this machine has {have} GPU(s) "
                          f"(cuda:0..{have - 1}); use trainer.devices={have} or fewer, or "
                          "trainer.num_nodes for more machines")


def check_memory(cfg: DictConfig, run: RunFolder | None = None) -> MemoryConfig:
    """The memory mode of ``cfg.memory``; refuses a precision this machine cannot run."""
    (run or RunFolder.detached()).fill(cfg, "trainer.precision", lambda: check_precision(
        cfg.trainer.precision, cfg.trainer.get("accelerator", "auto")))
    group = cfg.get("memory")
    return memory_config(resolved(group) if group is not None else None)


def resolve_auto_tile(cfg: DictConfig, model: Any, fp: Any, dm: TileDataModule,
                      memory: MemoryConfig, run: RunFolder | None = None) -> None:
    """``tiling.tile_size=auto``: measure the largest tile within ``memory.budget_gb``.

    Sets ``tiling.tile_size`` (and the random mode's ``core_size``) in ``cfg`` and ``dm``;
    the saved run config holds the measured value (a resumed run takes it from there).
    """
    t, m = cfg.tiling, cfg.memory
    if t.tile_size != "auto":
        return
    if t.mode == "grid" and t.q is not None:
        raise ConfigError(f"tiling.tile_size=auto with tiling.q={t.q}: give one of them; "
                          "use tiling.q=null to let the memory budget choose the tile")
    sizes = []
    for scene in dm.scenes_of("train"):
        with RasterReader(scene.image) as r:
            sizes.append(covering_side(fp, r.height, r.width))
    acc = str(cfg.trainer.get("accelerator", "auto"))
    cuda = acc in ("gpu", "cuda") or (acc == "auto" and torch.cuda.is_available())
    search, keys = auto_tile(
        model, fp, memory, budget_gb=m.get("budget_gb"),
        batch=t.batch_size if t.mode == "random" else 1, precision=cfg.trainer.precision,
        channels_last=bool(cfg.task.get("channels_last", False)), max_side=max(sizes),
        device="cuda" if cuda else "cpu", rel_tol=m.get("rel_tol", 0.05),
        max_probes=m.get("max_probes", 8),
        host_rss=None if cuda else psutil.Process().memory_info().rss)
    run = run or RunFolder.detached()
    run.fill(cfg, "tiling.tile_size", lambda: keys["tile_size"])
    if t.mode == "random":
        run.fill(cfg, "tiling.core_size", lambda: keys["core_size"])
    dm.tiling = replace(dm.tiling, tile_size=keys["tile_size"],
                        core_size=cfg.tiling.core_size or dm.tiling.core_size)
    log.info("tiling.tile_size=auto: %s", search.summary())


def train_batch_size(cfg: DictConfig) -> int:
    """Samples per training step: the random tiles' batch, or 1 grid tile."""
    return int(cfg.tiling.batch_size) if cfg.tiling.mode == "random" else 1


def resolve_run_pipeline(cfg: DictConfig, model: Any, dm: TileDataModule,
                         memory: MemoryConfig) -> PipelineConfig | None:
    """The ``pipeline`` group resolved (balance profiled for ``auto``), or None.

    In a pipeline, ``memory=checkpoint`` becomes Pipe's own recomputation
    (``except_last``, or ``always`` with ``memory.checkpoint_last``); offloading is not
    available inside Pipe's worker threads.
    """
    group = cfg.get("pipeline")
    if group is None:
        return None
    g = pipeline_group(resolved(group))
    if g.mode == "none":
        return None
    if memory.mode in ("offload", "checkpoint_offload"):
        raise ConfigError(f"memory={memory.mode} with pipeline={g.mode}: saved tensors "
                          "cannot be offloaded inside Pipe's stage threads; use "
                          "memory=checkpoint (Pipe recomputation) or pipeline=none")
    if memory.mode == "checkpoint":
        g = replace(g, checkpoint=pipe_checkpoint_mode(memory))
    ds = dm.train_dataloader().dataset
    tile_shape = tuple(ds[0]["image"].shape)
    return resolve_pipeline(g, model, tile_shape, train_batch_size(cfg))


def prepare(cfg: DictConfig, run: RunFolder) -> tuple[Any, Any, MemoryConfig,
                                                   TileDataModule, dict[str, Any]]:
    """Everything before the first training step; every check runs here.

    Returns:
        ``(model, footprint, memory mode, DataModule, computed values)``.
    """
    data, tiling = checked_groups(cfg)  # data / tiling keys: type, range, unknown keys
    check_trainer(cfg)
    seed = cfg.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ConfigError(f"seed={seed!r}: give a whole number from 0 to {2**32 - 1}")
    pl.seed_everything(seed, workers=True)
    run.fill(cfg, "data.class_names", lambda: class_names_of(cfg.data))
    check_monitor(cfg)
    tune = cfg.get("finetune") or {}  # its values, before the model is built (seconds)
    check_finetune_values(tune.get("freeze_bn", "auto"), tune.get("freeze_encoder_epochs", 0),
                          tune.get("encoder_lr_scale", 1.0))
    model = build_model(resolved(cfg.model), where="the model group",
                        trust=bool(cfg.get("trust_run", False)))
    fp = run_footprint(model, cfg.tiling)  # tiling.exact=false: the approximate one
    computed: dict[str, Any] = {}
    use_weights_normalization(cfg, model, run, computed)  # finetune.normalization
    memory = check_memory(cfg, run)  # memory mode + precision
    report = run_preflight(data, run, bool(cfg.predict_after_fit))  # every split's files
    resolve_normalization(cfg, run, report, computed)  # data.scale/mean/std=auto
    record_training_data(cfg, report, computed)  # dtype, range, fingerprint: for seg-predict
    # the data group's _target_ is the DataModule (its keys plain values, the rest objects)
    dm: TileDataModule = instantiate(cfg.data, _partial_=True, _convert_="all")(
        tiling=tiling, footprint=fp, seed=cfg.seed, scenes=report.scenes)
    resolve_auto_tile(cfg, model, fp, dm, memory, run)  # tiling.tile_size=auto
    check_grids(cfg, fp, report)
    if tiling.mode == "grid":  # a batch limit that ends each epoch before an image's step
        dm.whole_images_per_epoch(cfg.trainer.get("limit_train_batches"),
                                  process_count(resolved(cfg.trainer)))
    computed.update(computed_values(dm, fp, cfg))
    # what its predictions tile with (seg-predict's ranks read it before the network)
    computed["predict_halo"] = prediction_footprint(model, cfg.tiling).halo
    computed["preflight_s"] = round(report.seconds, 3)
    return model, fp, memory, dm, computed


def fit(cfg: DictConfig, run: RunFolder, model: Any, fp: Any, memory: MemoryConfig,
        dm: TileDataModule, computed: dict[str, Any], ckpt: str | None
        ) -> tuple[pl.Trainer, Any, list[Any]]:
    """Build the task, callbacks, loggers and trainer; fit (resuming when asked)."""
    pipeline = resolve_run_pipeline(cfg, model, dm, memory)  # pipeline=manual|auto
    if pipeline is not None:
        computed["pipeline"] = pipeline.as_dict()
    log.info("halo %d (context %d, align %d, %s padding), E = %.3f on the validation grid %s",
             fp.halo, fp.context, fp.align, fp.padding, computed["efficiency"],
             computed["grid"])
    task = instantiate(cfg.task, model=model if pipeline else apply_memory_mode(model, memory))
    warn_training_norms(model, cfg, getattr(task, "freeze_bn", "none"))
    setup_pipeline(task, pipeline, batch_size=train_batch_size(cfg))
    slurm = cfg.get("slurm") or {}
    plugins = slurm_plugins(bool(slurm.get("auto_requeue", True)),
                            str(slurm.get("requeue_signal", "SIGUSR1"))) or plain_environment()
    stop = SaveOnStop(run.path / "checkpoints", requeue_signal=next(
        (p.requeue_signal for p in plugins if getattr(p, "auto_requeue", False)), None))
    loggers = [instantiate(c) for c in cfg.logger.values()] if cfg.logger else []
    callbacks = [instantiate(c) for c in cfg.callbacks.values()] + [
        MemoryReport(memory.label), stop, RecordMeaning(run.path), FiniteLoss(cfg)]
    if not loggers:  # logger=none: Lightning refuses a learning-rate monitor with no logger
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    # the live bar where it is seen as it goes; elsewhere (a Slurm job's output, nohup, a
    # pipe) a line per epoch: the bar written to a file shows nothing until the run ends
    bar = OmegaConf.select(cfg, "trainer.enable_progress_bar", default=True) is not False \
        and bar_is_seen()
    if not bar:
        callbacks.append(EpochLines())
    if OmegaConf.select(cfg, "trainer.enable_model_summary", default=True) is not False:
        callbacks.append(ModelTable())  # Lightning's table, less the FLOPs it never counts
    # the trainer before the run's config: what Lightning refuses leaves no run behind, so
    # the corrected command may use the same folder (a saved config is a run to resume)
    trainer = build_trainer(cfg.trainer, callbacks=callbacks, logger=loggers or False,
                            plugins=plugins or None, enable_progress_bar=bar,
                            enable_model_summary=False,  # ModelTable instead, when asked
                            **pipeline_strategy(cfg.trainer, pipeline))
    run.save(cfg, computed)
    for lg in loggers:
        lg.log_hyperparams({"computed": computed})
    try:
        trainer.fit(task, datamodule=dm, ckpt_path=ckpt,  # plain data unless trusted
                    weights_only=not bool(cfg.get("trust_run", False)))
    except SIGTERMException:  # checkpoint saved by SaveOnStop; exit as the signal asks
        # Lightning has put back the default action; a second SIGTERM (a Slurm step's
        # cancel signals its processes again) would kill the exit ("Terminated", not 143)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + (stop.signal or signal.SIGTERM)) from None
    return trainer, task, loggers


class RecordMeaning(pl.Callback):
    """Each checkpoint records what its weights mean.

    That is :func:`weights_meaning` of the run's saved config: loading the checkpoint under
    another run's classes or normalisation is refused.
    """

    def __init__(self, run: Path) -> None:
        self.run = run
        self.meaning: dict[str, Any] | None = None

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if not trainer.is_global_zero:  # rank 0 writes the file
            return
        if self.meaning is None:  # the config as saved (computed values in) and as loaded
            self.meaning = weights_meaning(read_run_config(self.run))
        checkpoint[MEANING_KEY] = self.meaning


class FiniteLoss(pl.Callback):
    """Stop a run whose loss is NaN or infinite, before it saves the weights it ruined.

    Checked at each image's end (a grid image's last tile, or a batch of random tiles), on
    every rank at once: a diverged run trained on, saved NaN weights as its best checkpoint
    and predicted class 0 everywhere, exit 0. The checkpoints of the epochs before stay.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self.lr = OmegaConf.select(cfg, "task.optimizer.lr", default=None)
        self.bad = False

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss).all()):
            self.bad = True
        if isinstance(batch, dict) and "last" in batch and not bool(batch["last"].all()):
            return  # not an image's end: the ranks agree there
        bad = torch.tensor(float(self.bad), device=trainer.strategy.root_device)
        if trainer.world_size > 1:
            bad = trainer.strategy.reduce(bad, reduce_op="max")
        if float(bad):
            raise SegAtScaleError(
                f"the training diverged: the loss is NaN or infinite at epoch "
                f"{trainer.current_epoch}, step {trainer.global_step} (task.optimizer.lr="
                f"{self.lr}); train a new run with a lower task.optimizer.lr (or "
                "task.gradient_clip); the checkpoints of the epochs before are kept")


def _no_advert(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("💡 Tip:")


def run(cfg: DictConfig) -> float | None:
    """Write or check the scenes, then train in the run folder, one ``seg-train`` at a time."""
    quiet_srun_hint()
    # Lightning's own pytrees still make torch's LeafSpec, which torch deprecates: a warning
    # on every fit about code that is neither the user's nor this project's
    warnings.filterwarnings("ignore", message=re.escape("`isinstance(treespec, LeafSpec)`"),
                            category=FutureWarning)
    # and Lightning's advertisement of its cloud logger on every fit (console and train.log)
    logging.getLogger("pytorch_lightning.utilities.rank_zero").addFilter(_no_advert)
    predict_options(cfg)  # the predict: block checked before any work
    synthesize(cfg)  # the scenes first: data.class_weights may be read from their masks
    folder = Path(HydraConfig.get().runtime.output_dir)
    # one seg-train per run folder; its wandb run ends with it (a sweep's next run its own)
    with run_lock(folder), own_tracker_run():
        return _train(cfg, folder)


def _train(cfg: DictConfig, folder: Path) -> float | None:
    run = RunFolder.open(folder, cfg)  # before any write
    ckpt = resolve_ckpt(cfg, run)
    run.announce()  # accepted: only now into the run's train.log
    model, fp, memory, dm, computed = prepare(cfg, run)
    with group_of_its_own():  # sample parallelism ends with fit: every rank leaves the group
        trainer, task, loggers = fit(cfg, run, model, fp, memory, dm, computed, ckpt)
    if not trainer.is_global_zero:  # rank 0 predicts the test scenes alone and reports
        return None
    metric = trainer.callback_metrics.get("val/miou")  # none validated: the last, TrialRecord
    last = float(metric) if metric is not None else None
    saver = trainer.checkpoint_callback  # ModelCheckpoint (conf/callbacks), or None
    best = saver.best_model_path if isinstance(saver, ModelCheckpoint) else ""
    kept = saver.best_model_score if best and isinstance(saver, ModelCheckpoint) else None
    # val/miou: the checkpoint's that the test scenes are predicted with (and a sweep's
    # report ranks by); val/miou_last: the last epoch's
    summary: dict[str, Any] = {"run": str(run.path),
                               "val/miou": float(kept) if kept is not None else last,
                               "val/miou_last": last, "computed": computed,
                               "allocator": allocator()}  # tcmalloc where preloaded
    if best:
        task.load_state_dict(_state_dict(best))
        summary["checkpoint"] = best
    if cfg.predict_after_fit:
        summary["test"] = predict_test(cfg, task, dm, fp, run.path, loggers)
    (run.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    close_live_pipes()  # the stage threads stop now, not during the interpreter's exit
    return summary["val/miou"]


def _state_dict(path: str) -> dict[str, Any]:
    return load_checkpoint(path)["state_dict"]  # written by this run: plain data

