"""What the Slurm tests share: the tiny training problem, a job's log, weights, losses."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from helpers import warm

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "examples" / "slurm"
# the DDP tests' problem (tests/parallel/test_parallel_cli.py): 9 tiles per image, 2 images, SGD
TINY = ["logger=csv", "model=unet_tiny", "data.synthetic.height=157",
        "data.synthetic.width=189", "data.synthetic.splits={train:2,val:1,test:1}",
        "predict.tile_size=96", "predict.fast=false", "trainer.enable_progress_bar=false",
        "trainer.num_sanity_val_steps=0", "trainer.log_every_n_steps=1"]
SGD = ["task.optimizer._target_=torch.optim.SGD", "~task.optimizer.weight_decay",
       "task.optimizer.lr=0.05", "task.scheduler=null"]
EXACT = ["tiling=grid", "tiling.q=3", "predict_after_fit=false", *SGD]
EPOCHS = 5  # of the training and requeue tests (one one-process reference for both)


def train_cmd(run: Path, *overrides: str) -> list[str]:
    """``seg-train`` in one process, outside Slurm (the reference)."""
    return [sys.executable, "-m", "seg_at_scale.cli.train", f"hydra.run.dir={run}", *TINY,
            *overrides]


def start_reference(tmp: Path, run: str, env: dict[str, str], *overrides: str
                    ) -> Any:
    """The one-process run, in the background while a job runs (its log: ``<run>.log``)."""
    bare = {k: v for k, v in env.items() if k != "MASTER_ADDR"}
    log = open(tmp / f"{run}.log", "w")  # noqa: SIM115 - the child's
    return warm.popen(train_cmd(tmp / run, *overrides), stdout=log, stderr=subprocess.STDOUT,
                      env=bare, cwd=tmp)


def finish(proc: Any, log: Path, timeout: float = 300) -> str:
    """Wait for a background run; its log (asserting it succeeded)."""
    code = proc.wait(timeout)
    text = log.read_text()
    assert code == 0, text[-3000:]
    return text


def params(run: Path, name: str = "last.ckpt") -> dict[str, torch.Tensor]:
    """The model's weights in a run's checkpoint."""
    ckpt = torch.load(run / "checkpoints" / name, map_location="cpu", weights_only=True)
    return {k: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """The DDP tests' equality: same keys, every tensor within float32 reduction noise."""
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)


def losses(run: Path) -> dict[str, list[float]]:
    """A run's logged losses, in order: ``train`` one per optimiser step (an image: the
    value is logged on its last tile and repeated until the next image's), ``val`` per
    epoch."""
    rows = []
    for version in sorted((run / "csv").glob("version_*")):
        with open(version / "metrics.csv") as f:
            rows += list(csv.DictReader(f))
    train = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    return {"train": [v for i, v in enumerate(train) if i == 0 or v != train[i - 1]],
            "val": [float(r["val/loss"]) for r in rows if r.get("val/loss")]}


def job_log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no job output)"
