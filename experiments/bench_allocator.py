"""The commands under tcmalloc against glibc's malloc: seg-predict and seg-train on the CPU.

    .venv/bin/python experiments/bench_allocator.py            # 8192^2 scene, 3 alternations
    .venv/bin/python experiments/bench_allocator.py --quick    # 1536^2, 1 alternation (smoke)

The same command line is started with ``SEG_AT_SCALE_MALLOC=system`` (glibc, with huge
pages for torch's tensors), with the default (tcmalloc preloaded where installed,
:mod:`seg_at_scale.cli.malloc`, without huge pages) and with tcmalloc and huge pages
(``auto_thp``: ``THP_MEM_ALLOC_ENABLE=1``, the choice the default does not make), alternated
so the shared cores' drift cancels:

1. ``predict``: ``seg-predict`` of the demo U-Net (levels 4, width 16, random weights, fast,
   ``tile_size=auto``) on the synthetic 8192^2 4-band scene (256^2 zlib tiles) to a COG.
2. ``train``: ``seg-train`` of the demo's default config for 2 epochs on the synthetic data
   (no prediction after it, CSV logger).
3. ``staged``: ``seg-predict staged=true`` (fp32) of an smp Unet-ResNet34 (random weights)
   on a 2048^2 scene: the path whose memory bound rests on returning freed memory between
   stages (glibc's trim, tcmalloc's release).

Per run: wall seconds, the process's user and system CPU seconds and its peak RSS (from
``wait4``), and for ``seg-predict`` its own split. The labels of both predictions are
compared (the allocator must not change a bit). Skipped where no tcmalloc is installed.
``speedup_wall`` is glibc's seconds over the default's, ``thp_cost`` tcmalloc with huge
pages over the default (above 1: the default, without them, is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from common import fake_run, labels_equal, run_measured, save, synthetic_scene

from seg_at_scale.cli.malloc import ENV, find_tcmalloc

DATA = Path(__file__).resolve().parents[1] / "data" / "bench" / "allocator"
KINDS = ("system", "auto", "auto_thp")


def timed(cmd: list[str], kind: str, cwd: Path) -> dict[str, Any]:
    """Run ``cmd`` as ``kind`` (above): wall, CPU, peak RSS, its JSON."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env.update({"CI": "true", ENV: "system" if kind == "system" else "auto"})
    if kind == "auto_thp":
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    res: dict[str, Any]
    res, out = run_measured(cmd, cwd, env, kind)
    if "{" in out:
        got = json.loads(out[out.index("{"):])
        res.update({k: got[k] for k in ("model_s", "finalize_s", "allocator") if k in got})
    return res


def predict_cmd(run: Path, image: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "seg_at_scale.cli.predict", f"run={run}", f"image={image}",
            f"output={out}", "preview=false", "progress=false", *extra, "overwrite=true",
            "stac=false", f"hydra.run.dir={out.parent / 'hydra'}"]


def train_cmd(folder: Path, epochs: int, quick: bool) -> list[str]:
    cmd = [sys.executable, "-m", "seg_at_scale.cli.train", f"trainer.max_epochs={epochs}",
           "predict_after_fit=false", "logger=csv", "trainer.enable_progress_bar=false",
           f"hydra.run.dir={folder}"]
    return cmd + (["+trainer.limit_train_batches=2", "+trainer.limit_val_batches=1"]
                  if quick else [])


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians of each kind, glibc's over the default's (above 1: the default faster) and
    tcmalloc with huge pages over the default."""
    med = {k: {f: statistics.median(r[f] for r in rs) for f in rs[0]
               if isinstance(rs[0][f], (int, float))} for k, rs in runs.items()}
    sysm, tcm, thp = med["system"], med["auto"], med["auto_thp"]
    return {"median": med, "speedup_wall": round(sysm["wall_s"] / tcm["wall_s"], 3),
            "peak_rss_ratio": round(tcm["peak_rss_mib"] / sysm["peak_rss_mib"], 3),
            "thp_cost": round(thp["wall_s"] / tcm["wall_s"], 3), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1536 px, one alternation (smoke)")
    p.add_argument("--size", type=int, default=0, help="scene side (default 8192)")
    p.add_argument("--repeats", type=int, default=0, help="alternations (default 3)")
    p.add_argument("--skip", default="", help="comma list of parts to skip: "
                                              "predict,train,staged")
    p.add_argument("--out", default="", help="result JSON (default results/bench_allocator.json)")
    args = p.parse_args(argv)
    lib = find_tcmalloc()
    if lib is None:
        print("skipped: no tcmalloc installed (apt-get install libtcmalloc-minimal4)")
        return 0
    size = args.size or (1536 if args.quick else 8192)
    repeats = args.repeats or (1 if args.quick else 3)
    skip = set(filter(None, args.skip.split(",")))
    work = DATA / ("quick" if args.quick else "full")
    work.mkdir(parents=True, exist_ok=True)
    load = [list(os.getloadavg())]
    figures: dict[str, Any] = {"tcmalloc": str(lib), "size": size, "repeats": repeats}
    if "predict" not in skip:
        image = synthetic_scene(DATA, size)
        run = fake_run(DATA / "demo_unet_run")
        outs = {k: work / f"{k}.tif" for k in KINDS}
        timed(predict_cmd(run, image, outs["auto"], "fast=true"), "auto", work)  # layout=auto
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
        for _ in range(repeats):
            for k in KINDS:
                runs[k].append(timed(predict_cmd(run, image, outs[k], "fast=true"), k, work))
        same = all(labels_equal(outs["system"], outs[k]) for k in KINDS[1:])
        figures["predict"] = {"what": f"seg-predict, demo U-Net, fast, tile_size=auto, "
                                      f"{size}^2 zlib scene -> COG", **summary(runs),
                              "labels_equal": same}
        load.append(list(os.getloadavg()))
    if "train" not in skip:
        runs = {k: [] for k in KINDS}
        for _ in range(repeats):
            for k in KINDS:
                folder = work / f"train_{k}"
                shutil.rmtree(folder, ignore_errors=True)
                runs[k].append(timed(train_cmd(folder, 1 if args.quick else 2, args.quick),
                                     k, work))
        figures["train"] = {"what": "seg-train, the demo's default config (synthetic data, "
                                    "U-Net small), 2 epochs, no prediction after it",
                            **summary(runs)}
        load.append(list(os.getloadavg()))
    if "staged" not in skip:
        side = 512 if args.quick else 2048
        image = synthetic_scene(DATA, side)
        run = fake_run(DATA / "unet_resnet34_run", node={
            "_target_": "seg_at_scale.models.SMPModel", "arch": "Unet", "encoder": "resnet34"})
        outs = {k: work / f"staged_{k}.tif" for k in KINDS}
        runs = {k: [] for k in KINDS}
        for _ in range(repeats):
            for k in KINDS:
                cmd = predict_cmd(run, image, outs[k], "staged=true", "fast=false")
                runs[k].append(timed(cmd, k, work))
        figures["staged"] = {"what": f"seg-predict staged=true fp32, smp Unet-ResNet34, "
                                     f"{side}^2 zlib scene -> COG", **summary(runs),
                             "labels_equal": all(labels_equal(outs["system"], outs[k])
                                                 for k in KINDS[1:])}
        load.append(list(os.getloadavg()))
    figures["load_avg"] = load
    save("bench_allocator", figures, Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
