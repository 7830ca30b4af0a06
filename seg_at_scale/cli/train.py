"""Train a segmentation network on halo tiles, then predict the held-out scenes whole.

Run it::

    seg-train                                   # synthetic data, small U-Net, ~5 min on 2 CPU cores
    seg-train model_size=tiny tiling=grid tiling.q=2 trainer.max_epochs=5
    seg-train experiment=unet2015 logger=csv
    seg-train -m tiling.q=1,2,4 tiling=grid     # Hydra multirun sweep
    seg-train -m hparams_search=lr_sweep

An interrupted run resumes from its last checkpoint: rerun the same command with
``hydra.run.dir=<the run's folder>``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import hydra
import pytorch_lightning as pl
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig

from seg_at_scale.cli.common import (
    format_iou,
    model_footprint,
    normalizer_of,
    predict_scene,
    save_run_config,
)
from seg_at_scale.data.datamodule import TileDataModule
from seg_at_scale.io import RasterReader
from seg_at_scale.tiling import make_grid

log = logging.getLogger("seg_at_scale.train")
DEFAULT_GENERATOR = "seg_at_scale.data.synthetic_dataset.make_dataset"
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def build_data(cfg: DictConfig, fp: Any) -> TileDataModule:
    """Make the synthetic scenes if asked, and the DataModule."""
    d, t = cfg.data, cfg.tiling
    if d.synthetic.enabled:
        # data.synthetic.generator: a function (root, splits, height, width, seed) writing
        # <root>/<split>/<name>_image.tif + _mask.tif; the satellite scenes by default.
        maker = get_method(d.synthetic.get("generator") or DEFAULT_GENERATOR)
        maker(d.root, splits=dict(d.synthetic.splits), height=d.synthetic.height,
              width=d.synthetic.width, seed=d.synthetic.seed)
    return TileDataModule(
        d.root, fp, d.num_classes, mode=t.mode, q=t.q, tile_size=t.tile_size,
        core_size=t.core_size or 128, samples_per_epoch=t.samples_per_epoch or 0,
        batch_size=t.batch_size, num_workers=d.num_workers, scale=d.scale, mean=d.mean,
        std=d.std, class_weights=d.class_weights, ignore_index=d.ignore_index,
        nodata=d.nodata, augment=dict(t.augment) if t.augment else None, seed=cfg.seed)


def computed_values(dm: TileDataModule, fp: Any, cfg: DictConfig) -> dict[str, Any]:
    """Halo, alignment and efficiency E of the validation grid: saved with the run."""
    scene = dm.scenes_of("val")[0]
    with RasterReader(scene.image) as r:
        grid = make_grid(r.height, r.width, fp, q=cfg.tiling.q,
                         tile_size=None if cfg.tiling.q else cfg.tiling.tile_size)
        size = [r.height, r.width]
    return {"halo": fp.halo, "context": fp.context, "align": fp.align, "padding": fp.padding,
            "out_residue": fp.out_residue, "grid": list(grid.shape), "scene_size": size,
            "efficiency": round(grid.efficiency, 4)}


def resolve_ckpt(cfg: DictConfig, out_dir: Path) -> str | None:
    """Checkpoint to resume from: ``auto`` = the run folder's last.ckpt when present."""
    if cfg.ckpt_path in (None, "none"):
        return None
    if cfg.ckpt_path == "auto":
        last = out_dir / "checkpoints" / "last.ckpt"
        return str(last) if last.exists() else None
    return str(cfg.ckpt_path)


def predict_test(cfg: DictConfig, task: Any, dm: TileDataModule, fp: Any, out_dir: Path,
                 loggers: list[Any]) -> list[dict[str, Any]]:
    """Predict each test scene whole (streaming, tiled) and score it against its mask."""
    results = []
    for scene in dm.scenes_of("test"):
        res = predict_scene(
            task.model, fp, scene.image, out_dir / "predictions" / f"{scene.name}_pred.tif",
            normalizer=normalizer_of(cfg.data), tile_size=cfg.predict.tile_size, q=None,
            fast=cfg.predict.fast, overwrite=True, nodata=cfg.data.nodata, mask=scene.mask,
            num_classes=cfg.data.num_classes, ignore_index=cfg.data.ignore_index,
            preview=cfg.predict.preview)
        results.append(res)
        for lg in loggers:
            if hasattr(lg, "log_image") and "preview" in res:
                lg.log_image(key=f"test/{scene.name}", images=[res["preview"]])
            lg.log_metrics({"test/miou": res["miou"]})
        log.info("test scene %s:\n%s", scene.name, format_iou(res, list(cfg.data.class_names)))
    return results


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Train, validate, predict the test scenes; returns ``val/miou`` for sweeps."""
    pl.seed_everything(cfg.seed, workers=True)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    model = instantiate(cfg.model)
    fp = model_footprint(model, cfg.tiling.halo)
    dm = build_data(cfg, fp)
    computed = computed_values(dm, fp, cfg)
    save_run_config(cfg, out_dir, computed)
    log.info("halo %d (context %d, align %d, %s padding), E = %.3f on the validation grid %s",
             fp.halo, fp.context, fp.align, fp.padding, computed["efficiency"],
             computed["grid"])
    task = instantiate(cfg.task, model=model)
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
    loggers = [instantiate(c) for c in cfg.logger.values()] if cfg.logger else []
    for lg in loggers:
        lg.log_hyperparams({"computed": computed})
    trainer: pl.Trainer = instantiate(cfg.trainer, callbacks=callbacks,
                                      logger=loggers or False)
    trainer.fit(task, datamodule=dm, ckpt_path=resolve_ckpt(cfg, out_dir))
    metric = trainer.callback_metrics.get("val/miou")
    summary: dict[str, Any] = {"run": str(out_dir), "val/miou": float(metric)
                               if metric is not None else None, "computed": computed}
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    if best:
        task.load_state_dict(_state_dict(best))
        summary["checkpoint"] = best
    if cfg.predict_after_fit:
        summary["test"] = predict_test(cfg, task, dm, fp, out_dir, loggers)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary["val/miou"]


def _state_dict(path: str) -> dict[str, Any]:
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


if __name__ == "__main__":
    main()
