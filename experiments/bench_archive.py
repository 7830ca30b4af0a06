"""Many scenes in one command against a shell loop of one seg-predict per scene.

    .venv/bin/python experiments/bench_archive.py                  # 200 x 1000^2 + one 8000^2
    .venv/bin/python experiments/bench_archive.py --scenes 40 --large 4000   # a reduced run
    .venv/bin/python experiments/bench_archive.py --quick          # 8 x 400^2 + one 1200^2

For the tiny U-Net (levels 3, width 8) and the demo's small U-Net (levels 4, width 16;
``--run`` for a trained run folder, else random weights: the same throughput), fast path
(bf16 + channels_last), COG outputs, no preview / STAC, in one run so the ratios compare
like with like on the shared cores:

1. ``loop``: one ``seg-predict image=... output=...`` per scene, one after another, as a
   shell loop runs them: every scene pays a Python start, the imports and the model load;
2. ``archive_1`` / ``archive_2``: ``seg-predict images=<folder> output_dir=...`` with 1 and
   2 processes (the global work queue);
3. the large scene by itself, ``image=`` against ``images=`` of a folder holding only it:
   the whole command's wall time each (the archive machinery's cost on one big scene).

Every archive output is checked byte for byte against the loop's. Targets (the issue):
archive >= 3x the loop's throughput (tiny U-Net), >= 1.5x (small U-Net); the large scene
in the archive >= 0.9x its Mpix/s alone.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import RESULTS, fake_run, save

from seg_at_scale.data.sources.synthetic import write_scene
from seg_at_scale.data.synthetic import SceneGenerator
from seg_at_scale.io import RasterReader

DATA = Path(__file__).resolve().parents[1] / "data" / "bench" / "archive"
COMMON = ("fast=true", "preview=false", "stac=false", "progress=false", "tile_size=1024",
          "ckpt=last")


def scenes(n: int, side: int, large: int) -> Path:
    """``n`` synthetic scenes of about ``side``^2 (sizes vary by +-10 %) and one ``large``^2."""
    folder = DATA / f"{n}x{side}_{large}"
    done = folder / ".complete"
    if done.exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    masks = folder.parent / f"{folder.name}_masks"
    masks.mkdir(exist_ok=True)
    print(f"generating {n} scenes of ~{side}^2 and one of {large}^2 ...", flush=True)
    for k in range(n):
        jitter = side // 5
        h = side + (k * 37) % jitter - jitter // 2
        w = side + (k * 53) % jitter - jitter // 2
        write_scene(folder / f"scene_{k:04d}.tif", masks / f"scene_{k:04d}.tif",
                    SceneGenerator(k, h, w), compression=None, overwrite=True)
    write_scene(folder / "large.tif", masks / "large.tif", SceneGenerator(999, large, large),
                compression=None, overwrite=True)
    done.touch()
    return folder


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)} | {
        "CI": "true"}


def seg_predict(*args: str) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "seg_at_scale.cli.predict", *COMMON, *args],
                         capture_output=True, text=True, env=_env())
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return seconds, json.loads(out.stdout[out.stdout.index("{"):])


def loop(run: Path, folder: Path, out: Path) -> float:
    """One seg-predict per scene, one after another; the wall time."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    for image in sorted(folder.glob("*.tif")):
        seg_predict(f"run={run}", f"image={image}", f"output={out / image.name}")
    return time.perf_counter() - t0


def archive(run: Path, folder: Path, out: Path, processes: int) -> tuple[float, dict]:
    shutil.rmtree(out, ignore_errors=True)
    seconds, res = seg_predict(f"run={run}", f"images={folder}", f"output_dir={out}",
                               f"processes={processes}")
    with (out / "summary.csv").open() as f:
        rows = {r["stem"]: r for r in csv.DictReader(f)}
    return seconds, {"result": res, "large": rows["large"]}


def same_bytes(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.glob("*.tif"))
    return names == sorted(p.name for p in b.glob("*.tif")) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names)


def large_scene(name: str, run: Path, folder: Path, work: Path, repeats: int = 2
                ) -> dict[str, Any]:
    """The large scene alone: ``image=`` against ``images=`` of a folder holding only it,
    alternated ``repeats`` times (whole commands; the medians compared)."""
    print(f"[{name}] the large scene: image= and images= ...", flush=True)
    only = work / "only_large"
    shutil.rmtree(only, ignore_errors=True)  # never another size's scene
    only.mkdir(parents=True)
    (only / "large.tif").symlink_to(folder / "large.tif")
    alone, arch = [], []
    for _ in range(repeats):
        alone.append(seg_predict(f"run={run}", f"image={folder / 'large.tif'}",
                                 f"output={work / 'large_alone.tif'}", "overwrite=true")[0])
        t, res = archive(run, only, work / "large_archive", 1)
        assert int(res["large"]["tiles_computed"]) == int(res["large"]["tiles"]) > 0
        arch.append(t)
    with RasterReader(folder / "large.tif") as r:
        mp = r.height * r.width / 1e6
    t_alone, t_arch = sorted(alone)[len(alone) // 2], sorted(arch)[len(arch) // 2]
    return {"megapixels": round(mp, 1), "alone_s": [round(t, 1) for t in alone],
            "archive_s": [round(t, 1) for t in arch],
            "alone_mpix_per_s": round(mp / t_alone, 3),
            "archive_mpix_per_s": round(mp / t_arch, 3),
            "archive_vs_alone": round(t_alone / t_arch, 3)}


def measure(name: str, run: Path, folder: Path, megapixels: float,
            large_repeats: int = 2) -> dict[str, Any]:
    work = DATA / "out" / folder.name / name  # one folder per archive size
    print(f"[{name}] shell loop ...", flush=True)
    t_loop = loop(run, folder, work / "loop")
    figures: dict[str, Any] = {"loop_s": round(t_loop, 1),
                               "loop_mpix_per_s": round(megapixels / t_loop, 3)}
    for processes in (1, 2):
        print(f"[{name}] archive, {processes} process(es) ...", flush=True)
        t, res = archive(run, folder, work / f"archive_{processes}", processes)
        large = res["large"]
        figures[f"archive_{processes}"] = {
            "seconds": round(t, 1), "mpix_per_s": round(megapixels / t, 3),
            "vs_loop": round(t_loop / t, 2),
            "identical_to_loop": same_bytes(work / "loop", work / f"archive_{processes}"),
            "large_tiles_by_rank": json.loads(large["tiles_by_rank"])}
    figures["large"] = large_scene(name, run, folder, work, large_repeats)
    return figures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenes", type=int, default=200)
    p.add_argument("--side", type=int, default=1000)
    p.add_argument("--large", type=int, default=8000)
    p.add_argument("--run", help="a trained run of the demo's small U-Net (default: random)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 x 256^2 + 768^2, the tiny U-Net only, the large scene once")
    p.add_argument("--out", help="JSON path (default experiments/results/bench_archive.json)")
    p.add_argument("--large-only", action="store_true",
                   help="only the large scene's comparison, merged into the --out JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.scenes, args.side, args.large = 2, 256, 768
    folder = scenes(args.scenes, args.side, args.large)
    megapixels = 0.0
    for image in folder.glob("*.tif"):
        with RasterReader(image) as r:
            megapixels += r.height * r.width / 1e6
    load_before = os.getloadavg()
    runs = {"tiny_unet": fake_run(DATA / "tiny_run", levels=3, base_width=8),
            "small_unet": Path(args.run) if args.run else fake_run(DATA / "small_run")}
    if args.large_only:
        path = Path(args.out) if args.out else RESULTS / "bench_archive.json"
        doc = json.loads(path.read_text())
        doc.setdefault("loops_and_archives_date", doc.get("date"))
        for name, run in runs.items():
            doc[name]["large"] = large_scene(name, run, folder,
                                             DATA / "out" / folder.name / name)
        doc["large_measured"] = {"load_before": load_before, "load_after": os.getloadavg()}
        save("bench_archive", {k: v for k, v in doc.items() if k not in ("benchmark",
                                                                           "machine")}, path)
        return
    if args.quick:
        runs.pop("small_unet")
    figures = {name: measure(name, run, folder, megapixels, 1 if args.quick else 2)
               for name, run in runs.items()}
    save("bench_archive", {
        "scenes": args.scenes, "side": args.side, "large": args.large,
        "megapixels": round(megapixels, 1), "small_unet_trained": bool(args.run),
        "load_before": load_before, "load_after": os.getloadavg(), **figures,
        "targets": {"tiny_vs_loop": 3.0, "small_vs_loop": 1.5, "large_archive_vs_alone": 0.9}},
        Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
