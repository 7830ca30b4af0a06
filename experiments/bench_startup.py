"""The commands with the network stack out of the garbage collector's reach, against without.

    .venv/bin/python experiments/bench_startup.py            # 3 alternations
    .venv/bin/python experiments/bench_startup.py --quick    # 1 alternation, no demo epoch

``seg-train`` and ``seg-predict`` import torch and Lightning with Python's cyclic collector
off and then freeze those objects (``gc.freeze``, :func:`seg_at_scale.cli.common.long_lived`).
The baseline is the same command in the same wrapper with that step made a no-op, i.e.
Python's stock behaviour: every full collection scans the ~900,000 objects of the stack,
and a forked DataLoader worker copies the pages they lie on. Each case starts fresh
processes, alternated so that the shared cores' drift cancels:

1. ``train_tiny``: ``seg-train`` of a tiny U-Net (``model=unet_tiny trainer=fast``) on 2 + 1
   + 1 synthetic 157 x 189 scenes: the size of a quick experiment, a CI run, a test.
2. ``train_demo``: the demo's default config for one epoch, no prediction after it.
3. ``predict``: ``seg-predict`` of the demo U-Net (random weights) on a 1024^2 scene to a
   COG; the labels of both arms are compared (must be equal).

Both arms run under tcmalloc where it is installed (``LD_PRELOAD``), as the commands
re-execute themselves (:mod:`seg_at_scale.cli.malloc`; the wrapper, a ``python -c``, is not
re-executed). Per run: wall seconds, user and system CPU seconds and peak RSS of the
process and the children it waited for (``wait4``). ``speedup_wall`` is the baseline's
median seconds over the default's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from common import fake_run, labels_equal, run_measured, save, synthetic_scene

from seg_at_scale.cli.malloc import find_tcmalloc

DATA = Path(__file__).resolve().parents[1] / "data" / "bench" / "startup"
ARMS = ("stock_gc", "long_lived")
# the command as ``python -m`` runs it; arm "stock_gc" marks the stack as already frozen,
# so long_lived() does nothing and the interpreter's collector works as it always does
WRAPPER = """
import runpy, sys
import seg_at_scale.cli.common as common
if sys.argv[1] == "stock_gc":
    common._FROZEN.append(True)
module, sys.argv = sys.argv[2], [sys.argv[2], *sys.argv[3:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""
TINY = ["model=unet_tiny", "trainer=fast", "logger=csv", "data.synthetic.height=157",
        "data.synthetic.width=189", "data.synthetic.splits={train:2,val:1,test:1}",
        "tiling.tile_size=96"]


def timed(arm: str, module: str, args: list[str], cwd: Path) -> dict[str, float]:
    """One fresh run of ``module`` as ``arm``: wall, CPU and peak RSS (``wait4``)."""
    env = {**os.environ, "CI": "true", "SEG_DATA_DIR": str(DATA / "data")}
    lib = find_tcmalloc()
    if lib is not None and not env.get("LD_PRELOAD"):
        env["LD_PRELOAD"] = str(lib)  # as the commands run (seg_at_scale.cli.malloc)
    return run_measured([sys.executable, "-c", WRAPPER, arm, module, *args], cwd, env, arm)[0]


def summary(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    med = {a: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for a, rs in runs.items()}
    base, ours = med["stock_gc"], med["long_lived"]
    return {"median": med, "speedup_wall": round(base["wall_s"] / ours["wall_s"], 3),
            "cpu_ratio": round((ours["user_s"] + ours["sys_s"])
                               / (base["user_s"] + base["sys_s"]), 3), "runs": runs}


def alternate(repeats: int, one: Any) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {a: [] for a in ARMS}
    for _ in range(repeats):
        for arm in ARMS:
            runs[arm].append(one(arm))
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one alternation, no demo epoch")
    p.add_argument("--repeats", type=int, default=0, help="alternations (default 3)")
    p.add_argument("--out", default="", help="result JSON (default results/bench_startup.json)")
    args = p.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    work = DATA / ("quick" if args.quick else "full")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    load = [list(os.getloadavg())]
    lib = find_tcmalloc()
    figures: dict[str, Any] = {"repeats": repeats, "tcmalloc": str(lib) if lib else None}

    def train(arm: str, extra: list[str]) -> dict[str, float]:
        folder = work / f"train_{arm}"
        shutil.rmtree(folder, ignore_errors=True)
        return timed(arm, "seg_at_scale.cli.train", [*extra, f"hydra.run.dir={folder}"], work)

    train("long_lived", TINY)  # the scenes written once, outside the timing
    figures["train_tiny"] = {"what": "seg-train model=unet_tiny trainer=fast, 2+1+1 scenes "
                                     "157x189, fresh process",
                             **summary(alternate(repeats, lambda a: train(a, TINY)))}
    load.append(list(os.getloadavg()))
    if not args.quick:
        demo = ["trainer.max_epochs=1", "predict_after_fit=false", "logger=csv",
                "trainer.enable_progress_bar=false"]
        train("long_lived", demo)  # the demo's scenes written once
        figures["train_demo"] = {"what": "seg-train, the demo's default config, 1 epoch, no "
                                         "prediction after it, fresh process",
                                 **summary(alternate(repeats, lambda a: train(a, demo)))}
        load.append(list(os.getloadavg()))
    image = synthetic_scene(DATA, 1024)
    run = fake_run(DATA / "demo_unet_run")

    def predict(arm: str) -> dict[str, float]:
        out = work / f"{arm}.tif"
        return timed(arm, "seg_at_scale.cli.predict", [
            f"run={run}", f"image={image}", f"output={out}", "preview=false", "stac=false",
            "progress=false", "overwrite=true", f"hydra.run.dir={work / 'hydra'}"], work)

    predict("long_lived")  # layout=auto's timing, once per machine
    figures["predict"] = {"what": "seg-predict, demo U-Net, 1024^2 scene -> COG, fresh process",
                          **summary(alternate(repeats, predict)),
                          "labels_equal": labels_equal(work / "stock_gc.tif",
                                                       work / "long_lived.tif")}
    load.append(list(os.getloadavg()))
    figures["load_avg"] = load
    save("bench_startup", figures, Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
