"""The prediction's input fingerprint: BLAKE3 on every core against SHA-256 on one.

    .venv/bin/python experiments/bench_input_hash.py            # 8192^2 scene, 5 alternations
    .venv/bin/python experiments/bench_input_hash.py --quick    # 1536^2, 1 alternation (smoke)

Before its first tile, a prediction hashes every byte of its input (the fingerprint that
recognises a finished output or a store as this prediction's; ``prediction.plan.input_id``).
That hash is serial work on the path of every scene: on a GPU that runs the 8192^2 scene's
network in about 0.17 s, SHA-256's one core took about as long again. Here the same scene
(the synthetic 4-band 8192^2 scene of ``bench_feed``, 256^2 zlib tiles, in the page cache) is
hashed by ``file_blake3`` (what the prediction runs: BLAKE3's tree mode on every core, read in
16 MiB chunks) and by ``file_sha256`` (the same file, SHA-256, streamed), alternated: wall and
CPU seconds of each, and GB/s of wall time. ``speedup`` is SHA-256's median wall over BLAKE3's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import save, synthetic_scene

from seg_at_scale.prediction.provenance import file_blake3, file_sha256

DATA = Path(__file__).resolve().parents[1] / "data" / "bench" / "feed"


def timed(fn: Callable[[Path], str], path: Path) -> tuple[float, float, str]:
    """Wall and CPU seconds (every thread of this process) of one hash, and the hash."""
    t0, c0 = time.perf_counter(), time.process_time()
    value = fn(path)
    return time.perf_counter() - t0, time.process_time() - c0, value


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1536 px, one alternation (smoke)")
    p.add_argument("--size", type=int, default=0, help="scene side (default 8192)")
    p.add_argument("--repeats", type=int, default=0, help="alternations (default 5)")
    p.add_argument("--out", default="", help="result JSON (default results/bench_input_hash.json)")
    args = p.parse_args(argv)
    size = args.size or (1536 if args.quick else 8192)
    repeats = args.repeats or (1 if args.quick else 5)
    image = synthetic_scene(DATA, size)
    nbytes = image.stat().st_size
    image.read_bytes()  # in the page cache: the hash, not the disk, is measured
    load = [list(os.getloadavg())]
    runs: dict[str, list[tuple[float, float]]] = {"blake3": [], "sha256": []}
    for _ in range(repeats):
        for name, fn in (("blake3", file_blake3), ("sha256", file_sha256)):
            wall, cpu, value = timed(fn, image)
            assert value.startswith(name + ":"), value
            runs[name].append((round(wall, 4), round(cpu, 4)))
    load.append(list(os.getloadavg()))
    figures: dict[str, Any] = {"size": size, "file_bytes": nbytes, "repeats": repeats,
                               "cores": len(os.sched_getaffinity(0))}
    for name, rs in runs.items():
        wall = statistics.median(r[0] for r in rs)
        figures[name] = {"wall_s": [r[0] for r in rs], "cpu_s": [r[1] for r in rs],
                         "median_wall_s": wall,
                         "median_cpu_s": statistics.median(r[1] for r in rs),
                         "gb_per_s": round(nbytes / wall / 1e9, 2)}
    figures["speedup"] = round(figures["sha256"]["median_wall_s"]
                               / figures["blake3"]["median_wall_s"], 2)
    figures["load_avg"] = load
    save("bench_input_hash", figures, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
