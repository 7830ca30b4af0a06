"""Parallel trials on one machine: 2 at a time (cores / 2 threads each) vs 1 at a time (all cores).

    .venv/bin/python experiments/bench_parallel_trials.py          # ~3-4 min on 2 cores

The same fixed sweep of 4 trials (a grid over the learning rate, ``seg-train -m``) is run
twice through the project's launcher, ``hydra/launcher=local_parallel``: with
``hydra.launcher.n_jobs=1`` (trials one after another, each with every core's thread) and
with ``n_jobs=2`` (two trials side by side, each with half the threads). Both pay the same
per-trial process start, so the ratio is the effect of running side by side. Each trial:
tiny U-Net, random 64 px cores in batches of 8, 2 epochs of 64 samples, validation on the
whole grid of one 384 x 384 scene, test-scene prediction. The load average before and
after each run is recorded (the machine is shared); the order of the two runs alternates
with --repeats.

Figures: wall time of each sweep, the speed-up (sequential / parallel), the torch threads
each trial recorded (trial.json) and its fit time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import add_harness_args, save

from seg_at_scale.data.sources.synthetic import make_dataset
from seg_at_scale.sweeps.launcher import available_cores
from seg_at_scale.sweeps.report import collect_trials

SIDE = 384
SPLITS = {"train": 4, "val": 1, "test": 1}
TRIAL = ["model=unet_tiny", "logger=csv", "trainer.enable_progress_bar=false",
         f"data.synthetic.height={SIDE}", f"data.synthetic.width={SIDE}",
         "data.synthetic.splits={train:4,val:1,test:1}", "tiling.core_size=64",
         "tiling.batch_size=8", "tiling.samples_per_epoch=64", "tiling.tile_size=256",
         "trainer.max_epochs=2", "predict.tile_size=256", "hydra.sweep.subdir=${hydra.job.num}",
         "task.optimizer.lr=0.001,0.002,0.005,0.01"]
QUICK = [*(t for t in TRIAL[:-1] if not t.startswith(("data.synthetic.", "tiling.samples",
                                                      "trainer.max_epochs"))),
         "data.synthetic.height=256", "data.synthetic.width=256",
         "data.synthetic.splits={train:4,val:1,test:1}", "tiling.samples_per_epoch=32",
         "trainer.max_epochs=1", "task.optimizer.lr=0.001,0.01"]


def sweep(data: Path, folder: Path, n_jobs: int, cores: int,
          trial: list[str] = TRIAL) -> dict[str, Any]:
    """Run the sweep with ``n_jobs`` at a time; wall time, load, per-trial records."""
    cmd = [sys.executable, "-m", "seg_at_scale.cli.train", "-m", *trial,
           "hydra/launcher=local_parallel", f"hydra.launcher.n_jobs={n_jobs}",
           f"hydra.launcher.cores={cores}", f"hydra.sweep.dir={folder}"]
    env = {**os.environ, "SEG_DATA_DIR": str(data), "WANDB_MODE": "offline"}
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    report = collect_trials(folder)
    return {"n_jobs": n_jobs, "wall_s": round(wall, 1),
            "load_avg_before": [round(v, 2) for v in load_before],
            "load_avg_after": [round(v, 2) for v in os.getloadavg()],
            "trials": [{"lr": r.value_of("task.optimizer.lr"), "status": r.status,
                        "threads": r.record.get("threads"), "fit_s": r.record.get("fit_s"),
                        "val_miou": r.objective} for r in report.rows]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs (order alternates)")
    add_harness_args(parser, "2 trials of one 32-sample epoch, 256 x 256 scenes")
    args = parser.parse_args(argv)
    trial, side = (QUICK, 256) if args.quick else (TRIAL, SIDE)
    cores = available_cores()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        make_dataset(data / f"synthetic_{side}x{side}_s0", splits=SPLITS, height=side,
                     width=side, seed=0)  # made once, outside the timed runs
        runs = []
        for r in range(args.repeats):
            order = (1, 2) if r % 2 == 0 else (2, 1)
            for n in order:
                runs.append(sweep(data, Path(tmp) / f"sweep_{r}_{n}", n, cores, trial))
                print(f"n_jobs={n}: {runs[-1]['wall_s']} s, load {runs[-1]['load_avg_after']}")
    seq = [x["wall_s"] for x in runs if x["n_jobs"] == 1]
    par = [x["wall_s"] for x in runs if x["n_jobs"] == 2]
    save("bench_parallel_trials", {
        "sweep": f"{len(trial[-1].split(','))} trials (grid over task.optimizer.lr), "
                 "hydra/launcher=local_parallel",
        "trial": " ".join(trial[:-1]), "cores": cores,
        "sequential_wall_s": seq, "parallel_wall_s": par,
        "speedup": round(min(seq) / min(par), 2), "runs": runs}, args.out)


if __name__ == "__main__":
    main()
