"""Predict a whole image file with a trained run, streaming tiles, exactly as untiled.

Run it::

    seg-predict run=runs/same_unet_small/<date> image=scene.tif output=scene_mask.tif
    seg-predict run=... image=big.tif output=big_mask.tif tile_size=2048 fast=false
    seg-predict run=... image=a.tif output=a_mask.tif mask=a_truth.tif   # also scores it

    seg-predict run=... image=big.tif output=big_mask.zarr processes=2   # 2 processes, zarr
    seg-predict run=... image=a.tif output=a_mask.tif probabilities=uint8 tta=d4

``output=*.tif`` is a Cloud-Optimized GeoTIFF (uint8 labels, 255 = no data, the input's
georeferencing, a colour table, mode overviews); ``output=*.zarr`` a Zarr v3 store. Both
are computed into a Zarr store first: a killed run rerun with the same command continues
from the tiles already written (``resume=false`` starts afresh). A PNG preview is drawn
beside the output. ``processes=N`` spreads the tiles over N local processes (Lightning
Fabric's DDP launch: gloo on CPU, NCCL on GPUs); under SLURM ``nodes`` x ``processes``
ranks come from the cluster environment.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import sys
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from seg_at_scale.cli.common import (
    RUN_CONFIG,
    USER_ERROR_EXIT,
    format_iou,
    model_footprint,
    normalizer_of,
    predict_scene,
    reports_errors,
)
from seg_at_scale.errors import ConfigError, InputError, SegAtScaleError
from seg_at_scale.prediction import output_kind

log = logging.getLogger("seg_at_scale.predict")
CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "conf")  # shipped in the wheel


def load_run(run: str | Path, ckpt: str = "best") -> tuple[DictConfig, nn.Module, Path]:
    """The run's saved config, its network with trained weights, and the checkpoint used."""
    run = Path(run)
    cfg_path = run / RUN_CONFIG
    if not cfg_path.exists():
        raise InputError(f"run='{run}' has no {RUN_CONFIG}; give the folder of a training "
                         "run (it holds run_config.yaml and checkpoints/)")
    cfg = OmegaConf.load(cfg_path)
    assert isinstance(cfg, DictConfig)
    path = _checkpoint(run, ckpt)
    model = instantiate(cfg.model)
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    model.load_state_dict({k[len("model."):]: v for k, v in state.items()
                           if k.startswith("model.")})
    return cfg, model.eval(), path


def _checkpoint(run: Path, ckpt: str) -> Path:
    folder = run / "checkpoints"
    if ckpt not in ("best", "last"):
        path = Path(ckpt)
    elif ckpt == "last":
        path = folder / "last.ckpt"
    else:
        ranked = sorted((p for p in folder.glob("*.ckpt") if p.name != "last.ckpt"),
                        key=lambda p: _miou_of(p.name))
        path = ranked[-1] if ranked else folder / "last.ckpt"
    if not path.exists():
        raise InputError(f"ckpt={ckpt!r}: no checkpoint at '{path}'; use ckpt=last, ckpt=best "
                         "or a path to a .ckpt file")
    return path


def _miou_of(name: str) -> float:
    try:
        return float(name.rsplit("miou", 1)[1].removesuffix(".ckpt"))
    except (IndexError, ValueError):
        return -1.0


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but CUDA is not available; use device=cpu")
    return torch.device(name)


def run_prediction(cfg: DictConfig, *, fork: bool = False) -> dict[str, Any]:
    """Predict ``cfg.image`` into ``cfg.output`` with the run ``cfg.run``.

    With ``processes`` x ``nodes`` > 1 this process launches (or joins) the ranks and
    returns rank 0's result. ``fork=True`` (the command line) forks the local CPU ranks
    from this process, which has run no torch computation yet, instead of re-running the
    command for each (Python's start costs ~7 s here); a caller that has already run torch
    code keeps the default, since OpenMP does not survive a fork.
    """
    processes, nodes = _positive(cfg, "processes"), _positive(cfg, "nodes")
    output_kind(Path(cfg.output))  # the extension names a format, before any work
    image = Path(cfg.image)
    if not image.exists():
        raise InputError(f"image='{image}' does not exist; give the path of a TIFF to predict")
    device = _device(cfg.device)
    if processes * nodes > 1:
        return _launch(cfg, processes, nodes, device, fork)
    return _predict(cfg, device)


def _predict(cfg: DictConfig, device: torch.device) -> dict[str, Any]:
    """This rank's share of the prediction (everything, with one process)."""
    train_cfg, model, ckpt = load_run(cfg.run, cfg.ckpt)
    model = model.to(device)
    fp = model_footprint(model, train_cfg.tiling.halo)
    names = train_cfg.data.get("class_names")
    res = predict_scene(model, fp, image=Path(cfg.image), output=Path(cfg.output),
                        normalizer=normalizer_of(train_cfg.data),
                        tile_size=cfg.tile_size, q=cfg.q, fast=cfg.fast,
                        overwrite=cfg.overwrite, nodata=cfg.nodata,
                        mask=Path(cfg.mask) if cfg.mask else None,
                        num_classes=train_cfg.data.num_classes,
                        ignore_index=train_cfg.data.ignore_index, preview=cfg.preview,
                        class_names=list(names) if names else None,
                        probabilities=cfg.probabilities, tta=cfg.tta,
                        batch_size=cfg.batch_size, resume=cfg.resume,
                        progress=cfg.progress, keep_store=cfg.keep_store)
    res["checkpoint"] = str(ckpt)
    res["halo"] = fp.halo
    res["threads"] = torch.get_num_threads()  # per process
    if "miou" in res:
        log.info("scores:\n%s", format_iou(res, list(names or [])))
    return res


def _positive(cfg: DictConfig, key: str) -> int:
    value = cfg.get(key, 1)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key}={value!r}: give a whole number >= 1 (e.g. {key}=2)")
    return value


def _launch(cfg: DictConfig, processes: int, nodes: int, device: torch.device,
            fork: bool) -> dict[str, Any]:
    """Start (or join) the ranks of a multi-process prediction; rank 0's result.

    Lightning Fabric launches them: on one machine's CPU (and ``fork``) by forking this
    process (``ddp_fork``); otherwise its DDP launcher re-runs this command for local ranks
    1..N-1, and on a SLURM allocation (or under torchrun) the cluster environment gives
    every rank instead. gloo on CPU, NCCL on GPUs; on CPU each process gets its share of
    the cores.
    """
    from lightning_fabric import Fabric
    from lightning_fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    external = SLURMEnvironment.detect() or TorchElasticEnvironment.detect()
    forked = (fork and device.type == "cpu" and nodes == 1 and not external
              and "fork" in multiprocessing.get_all_start_methods())
    fabric = Fabric(accelerator="cuda" if device.type == "cuda" else "cpu", devices=processes,
                    num_nodes=nodes, strategy="ddp_fork" if forked else "ddp")
    if not forked:
        return fabric.launch(_rank_main, cfg, processes, False)  # type: ignore[no-any-return]
    try:
        return fabric.launch(_rank_main, cfg, processes, True)  # type: ignore[no-any-return]
    except torch.multiprocessing.ProcessExitedException as exc:
        if exc.exit_code in (130, 143):
            raise (Stopped(signal.SIGTERM) if exc.exit_code == 143 else KeyboardInterrupt()
                   ) from None
        raise SystemExit(exc.exit_code if exc.exit_code > 0 else 128 - exc.exit_code) from None
    except KeyboardInterrupt:  # this process was signalled: stop the ranks too
        for child in multiprocessing.active_children():
            child.terminate()
        raise


def _rank_main(fabric: Any, cfg: DictConfig, processes: int, forked: bool) -> dict[str, Any]:
    """One rank of a multi-process prediction.

    A forked rank ends a refused input or a stop by its exit status (rank 0 prints the
    message); the launching process turns that into its own. (torch's launcher has the
    kernel send a rank SIGINT when the launching process dies, even by SIGKILL.)
    """
    if fabric.device.type == "cpu":  # OMP_NUM_THREADS, or this process's share of the cores
        threads = int(os.environ.get("OMP_NUM_THREADS") or 0)
        torch.set_num_threads(threads or max(1, _cores() // processes))
    if not forked:
        return _predict(cfg, fabric.device)
    try:
        return _predict(cfg, fabric.device)
    except SegAtScaleError as exc:
        if fabric.global_rank == 0:
            print(f"seg-predict: error: {exc}", file=sys.stderr, flush=True)
        status = USER_ERROR_EXIT
    except KeyboardInterrupt as exc:
        status = 143 if isinstance(exc, Stopped) else 130
    sys.stderr.flush()
    os._exit(status)  # every rank the same way; the launcher stops the others


def _cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class Stopped(KeyboardInterrupt):
    """SIGTERM (what SLURM sends before a kill): unwinds like Ctrl-C."""


def _terminate(signum: int, _: Any) -> None:
    raise Stopped(signum)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="predict")
@reports_errors("seg-predict")
def main(cfg: DictConfig) -> None:
    """Console entry point ``seg-predict``.

    On SIGTERM or Ctrl-C the run unwinds: temporary files are removed, the store keeps every
    finished tile, and the same command resumes (exit 143 / 130).
    """
    signal.signal(signal.SIGTERM, _terminate)
    try:
        res = run_prediction(cfg, fork=True)
    except KeyboardInterrupt as exc:
        what = "SIGTERM" if isinstance(exc, Stopped) else "Ctrl-C"
        print(f"seg-predict: stopped by {what}; the finished tiles are kept in the store: run "
              "the same command again to resume", file=sys.stderr, flush=True)
        raise SystemExit(143 if isinstance(exc, Stopped) else 130) from None
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
