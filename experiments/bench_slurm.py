"""Two Slurm nodes against one process, on this machine: a training step and a prediction.

    .venv/bin/python experiments/bench_slurm.py        # root, Slurm installed; ~2-5 min on 2 cores

Starts the tests' cluster (``tests/slurm/cluster.py``: a controller and two 1-CPU
``slurmd`` on this host) and runs the README's sbatch scripts on it against the same
command in one process with one thread, outside Slurm (the baseline):

* training: ``train.sbatch`` (``seg-train trainer=ddp trainer.num_nodes=2
  trainer.devices=1``, gloo) on an exact grid problem (2 images of 16 tiles, U-Net
  ``small``, SGD); figure: the whole-image optimiser step (the tile steps of an image
  summed, rank 0's, epochs after the first), the process's wall time, and the final
  weights' largest difference;
* prediction: ``predict.sbatch`` (``seg-predict nodes=2 processes=1``) of one raster;
  figure: the ``seconds`` seg-predict reports (reading, model, writing, the COG) and the
  wall time; the outputs' bytes compared.

Two 1-CPU nodes of one 2-core machine: the ideal ratio is 2.0, less what the machine's
other load takes (the load average is recorded before and after each run).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from common import add_harness_args, save, skip

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "slurm"), str(REPO / "tests")]
from cluster import Cluster, unavailable  # noqa: E402
from helpers.prediction import make_image, make_model, make_run  # noqa: E402

SCRIPTS = REPO / "examples" / "slurm"
TRAIN = ["logger=csv", "model=unet_small", "data.synthetic.height=1024",
         "data.synthetic.width=1024", "data.synthetic.splits={train:2,val:1,test:1}",
         "tiling=grid", "tiling.q=2", "trainer.max_epochs=3", "predict_after_fit=false",
         "trainer.enable_progress_bar=false", "trainer.num_sanity_val_steps=0",
         "trainer.log_every_n_steps=1", "task.optimizer._target_=torch.optim.SGD",
         "~task.optimizer.weight_decay", "task.optimizer.lr=0.05", "task.scheduler=null"]
QUICK = [{"model=unet_small": "model=unet_tiny", "data.synthetic.height=1024":
          "data.synthetic.height=256", "data.synthetic.width=1024": "data.synthetic.width=256",
          "trainer.max_epochs=3": "trainer.max_epochs=2"}.get(k, k) for k in TRAIN]
CONSOLE = ('#!{python}\nimport sys\nfrom {module} import main\nif __name__ == "__main__":\n'
           '    sys.exit(main())\n')


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def bin_dir(tmp: Path) -> Path:
    """``seg-train`` / ``seg-predict`` console scripts running this checkout."""
    folder = tmp / "bin"
    folder.mkdir()
    for name, module in (("seg-train", "seg_at_scale.cli.train"),
                         ("seg-predict", "seg_at_scale.cli.predict")):
        (folder / name).write_text(CONSOLE.format(python=sys.executable, module=module))
        (folder / name).chmod(0o755)
    return folder


def env_of(tmp: Path, bins: Path) -> dict[str, str]:
    return {"PATH": f"{bins}:/usr/bin:/bin", "PYTHONPATH": str(REPO), "CI": "true",
            "SEG_DATA_DIR": str(tmp / "data"), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
            "HOME": os.environ.get("HOME", "/root"), "MASTER_ADDR": "127.0.0.1"}


def one_process(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[float, str]:
    """Run a command outside Slurm; (wall seconds, output)."""
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return wall, out.stdout + out.stderr


def two_nodes(cluster: Cluster, script: str, args: list[str], env: dict[str, str],
              tmp: Path, name: str) -> tuple[float, str]:
    """Submit the README script on both nodes; (job wall seconds, job output)."""
    log = tmp / f"{name}.out"
    t0 = time.perf_counter()
    job = cluster.sbatch(["-N2", "-o", str(log), "--chdir", str(tmp), str(SCRIPTS / script),
                          *args], env)
    info = cluster.wait(job, timeout=1800)
    wall = time.perf_counter() - t0
    if info["JobState"] != "COMPLETED":
        raise RuntimeError(log.read_text()[-3000:])
    return wall, log.read_text()


def image_steps(run: Path, images: int) -> list[float]:
    """Whole-image step times after the first epoch: each image's tile steps summed."""
    with open(run / "csv" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/step_s")]
    by_epoch: dict[int, float] = {}
    for r in rows:
        by_epoch[int(r["epoch"])] = by_epoch.get(int(r["epoch"]), 0.0) + float(r["train/step_s"])
    return [t / images for e, t in sorted(by_epoch.items()) if e > 0]


def weights(run: Path) -> dict[str, torch.Tensor]:
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return ckpt["state_dict"]


def bench_training(cluster: Cluster, env: dict[str, str], tmp: Path,
                   train: list[str] = TRAIN) -> dict[str, Any]:
    res: dict[str, Any] = {"problem": "2 images 1024x1024 x 4 tiles (q=2), unet_small, SGD, "
                           "3 epochs; steps of epochs 2-3" if train is TRAIN else
                           "2 images 256x256 x 4 tiles (q=2), unet_tiny, SGD, 2 epochs; "
                           "steps of epoch 2"}
    before = load()
    wall1, _ = one_process([sys.executable, "-m", "seg_at_scale.cli.train",
                            f"hydra.run.dir={tmp / 'train1'}", *train], env, tmp)
    res["one_process"] = {"image_step_s": statistics.median(image_steps(tmp / "train1", 2)),
                          "wall_s": round(wall1, 1), "load_before": before,
                          "load_after": load()}
    before = load()
    wall2, _ = two_nodes(cluster, "train.sbatch", [f"hydra.run.dir={tmp / 'train2'}", *train],
                         env, tmp, "train2")
    res["two_nodes"] = {"image_step_s": statistics.median(image_steps(tmp / "train2", 2)),
                        "wall_s": round(wall2, 1), "load_before": before, "load_after": load()}
    res["step_speedup"] = round(res["one_process"]["image_step_s"] /
                                res["two_nodes"]["image_step_s"], 3)
    a, b = weights(tmp / "train1"), weights(tmp / "train2")
    res["weights_max_abs_diff"] = max(float((a[k] - b[k]).abs().max()) for k in a)
    return res


def bench_prediction(cluster: Cluster, env: dict[str, str], tmp: Path, side: int,
                     repeats: int) -> dict[str, Any]:
    run = make_run(tmp / "run", make_model("same", levels=4, width=16))
    image = make_image(tmp / "scene.tif", height=side, width=side)
    keys = [f"run={run}", f"image={image}", "tile_size=512", "fast=false", "progress=false"]
    res: dict[str, Any] = {"problem": f"{side}x{side} 4-band uint8, U-Net 4 levels width 16, "
                           "tile_size=512, fp32, COG output", "runs": []}
    for k in range(repeats):
        one, two = tmp / f"p1_{k}" / "mask.tif", tmp / f"p2_{k}" / "mask.tif"
        before = load()
        wall1, out1 = one_process([sys.executable, "-m", "seg_at_scale.cli.predict", *keys,
                                   f"output={one}"], env, tmp)
        mid = load()
        wall2, out2 = two_nodes(cluster, "predict.sbatch", [*keys, f"output={two}"], env, tmp,
                                f"predict2_{k}")
        s1, s2 = (json.loads(o[o.index("{\n"):o.rindex("}") + 1])["seconds"] for o in (out1, out2))
        res["runs"].append({"one_process_s": s1, "two_nodes_s": s2, "one_process_wall_s":
                            round(wall1, 1), "two_nodes_wall_s": round(wall2, 1),
                            "speedup": round(s1 / s2, 3), "load": [before, mid, load()],
                            "identical_bytes": one.read_bytes() == two.read_bytes()})
    res["speedup_median"] = statistics.median(r["speedup"] for r in res["runs"])
    res["identical_bytes"] = all(r["identical_bytes"] for r in res["runs"])
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", type=int, default=4096, help="prediction raster side")
    ap.add_argument("--repeats", type=int, default=2, help="prediction pairs")
    add_harness_args(ap, "tiny U-Net on 2 images of 256^2 for 2 epochs; one 1024^2 prediction")
    args = ap.parse_args(argv)
    reason = unavailable()
    if reason and args.quick:
        skip(f"needs Slurm ({reason})")
        return
    if reason:
        raise SystemExit(f"bench_slurm: {reason}")
    train = QUICK if args.quick else TRAIN
    if args.quick:
        args.side, args.repeats = 1024, 1
    with tempfile.TemporaryDirectory(prefix="bench-slurm-", dir="/tmp") as name:
        tmp = Path(name)
        os.chmod(tmp, 0o755)
        # its own name and job ids: the rendezvous ports differ from a test cluster's
        cluster = Cluster.create(tmp / "cluster", name="segbench", first_job_id=8001)
        cluster.start()
        try:
            env = env_of(tmp, bin_dir(tmp))
            version = cluster.client("sinfo", "-V").stdout.strip()
            figures: dict[str, Any] = {"cluster": "2 slurmd (1 CPU each) on this host, "
                                       f"{version}", "started": datetime.now().isoformat()}
            figures["training"] = bench_training(cluster, env, tmp, train)
            print(json.dumps(figures["training"], indent=2), flush=True)
            figures["prediction"] = bench_prediction(cluster, env, tmp, args.side, args.repeats)
        finally:
            left = cluster.stop()
        figures["left_running_after_stop"] = left
        import lightning_fabric
        figures["versions"] = {"lightning": lightning_fabric.__version__}
    save("bench_slurm", figures, args.out)


if __name__ == "__main__":
    main()
