"""An archive's search for dead writers' temporaries: one listing per folder against one per output.

    .venv/bin/python experiments/bench_sweep.py            # 300, 1000 and 3000 scenes
    .venv/bin/python experiments/bench_sweep.py --quick    # 100 scenes (smoke)

Before it writes a scene's COG, the prediction removes the temporaries a killed writer left
beside that output (``io.writer.remove_stale_temporaries``). An archive writes every scene
into one folder, which holds three files per finished scene (COG, STAC Item, preview): a
search that lists the folder per output reads ~3N names N times. Here a folder of N
finished scenes, with a killed writer's two temporaries beside every tenth, is searched for
every scene's output both ways, alternated: per output (``glob`` of the folder), and within
``listed_once`` (what ``predict_archive`` does: the folder read once). Both must remove the
same files; the figure is seconds per archive and the ratio. Local disk here; on a network
filesystem a listing costs far more, which is what the one listing saves.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import add_harness_args, save

from seg_at_scale.io.writer import listed_once, remove_stale_temporaries


def folder_of(root: Path, scenes: int, dead_pid: int) -> list[Path]:
    """``scenes`` finished outputs (+ STAC Item, preview) and a dead writer's temporaries
    beside every tenth; returns the outputs."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    outs = []
    for k in range(scenes):
        out = root / f"scene_{k:05d}.tif"
        for path in (out, root / f"{out.stem}.stac.json", root / f"{out.stem}_preview.png"):
            path.touch()
        if k % 10 == 0:
            (root / f".{out.name}.cog.{dead_pid}-0a1b2c3d.tmp").touch()
            (root / f".{out.name}.ov1.{dead_pid}.tmp").touch()
        outs.append(out)
    return outs


def sweep(outs: list[Path], once: bool) -> tuple[float, int]:
    t0 = time.perf_counter()
    if once:
        with listed_once([outs[0].parent]):
            removed = sum(remove_stale_temporaries(out) for out in outs)
    else:
        removed = sum(remove_stale_temporaries(out) for out in outs)
    return time.perf_counter() - t0, removed


def main(argv: list[str] | None = None) -> None:
    p = add_harness_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]),
                         "100 scenes, one alternation")
    p.add_argument("--repeats", type=int, default=0, help="alternations (default 3)")
    args = p.parse_args(argv)
    sizes = [100] if args.quick else [300, 1000, 3000]
    repeats = args.repeats or (1 if args.quick else 3)
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)
    load = [list(os.getloadavg())]
    figures: dict[str, Any] = {"repeats": repeats, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="sweep-") as tmp:
        for n in sizes:
            runs: dict[str, list[float]] = {"per_output": [], "listed_once": []}
            for _ in range(repeats):
                for name in runs:
                    outs = folder_of(Path(tmp) / "out", n, dead)
                    seconds, removed = sweep(outs, once=name == "listed_once")
                    assert removed == 2 * len(range(0, n, 10)), (name, removed)
                    runs[name].append(round(seconds, 5))
            per, once = (statistics.median(runs[k]) for k in ("per_output", "listed_once"))
            figures["cases"][str(n)] = {
                "scenes": n, "files_in_folder": 3 * n + 2 * len(range(0, n, 10)),
                "per_output_s": runs["per_output"], "listed_once_s": runs["listed_once"],
                "per_output_ms_per_scene": round(1000 * per / n, 3),
                "speedup": round(per / once, 1)}
    load.append(list(os.getloadavg()))
    figures["load_avg"] = load
    save("bench_sweep", figures, args.out)


if __name__ == "__main__":
    main()
