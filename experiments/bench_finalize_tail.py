"""The labels' COG after the last tile: the per-pixel passes on every core against on one.

    .venv/bin/python experiments/bench_finalize_tail.py            # 8192^2, 3 alternations
    .venv/bin/python experiments/bench_finalize_tail.py --quick    # 2048^2, one (smoke)

After the last tile, rank 0 turns the prediction store into the COG
(``prediction.finalize``): each row band is read, its labels counted (the class
histogram), passed through the mode overviews and written, and GDAL copies the result into
the COG with every core. With one tile (a scene the device takes whole, as ``tile_size=auto``
does on a large GPU) all of it follows the network: nothing overlaps it. The histogram and
the overviews run in row pieces on the pixel threads (``io.threads.by_rows``); the peer is
the same code with one piece per band (``PIECE_PIXELS`` out of reach), as before. The
labels are the synthetic scene's truth (5 classes, ``scene<side>_mask.tif``) in a store of
one chunk (``one_tile``) and of the 25 chunks of the 2048 grid (``grid``); the two COGs are
compared byte for byte.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import as_commands  # noqa: F401 - before numpy's first big array: the commands' malloc

# isort: split
from common import add_harness_args, save, synthetic_scene

import seg_at_scale.io.threads as threads
from seg_at_scale.io import RasterReader, read_raster
from seg_at_scale.prediction.finalize import finalize
from seg_at_scale.prediction.store import PredictionStore
from seg_at_scale.tiling import Footprint, make_grid

DATA = Path(__file__).resolve().parents[1] / "data" / "bench" / "feed"  # bench_feed's scene
NAMES = ["c0", "c1", "c2", "c3", "c4"]


def finalized(folder: Path, image: Path, labels: Any, tile: int, pieces: bool) -> float:
    """Seconds of ``finalize`` of a store of ``labels`` cut in ``tile`` cores."""
    h, w = labels.shape
    grid = make_grid(h, w, Footprint(46, 8, "same"), tile_size=tile, uniform=True)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    store = PredictionStore.open(folder / "out.zarr", grid, fingerprint={"bench": 1},
                                 num_classes=len(NAMES), probabilities=None, attrs={},
                                 resume=False)
    for t in grid.tiles:
        rows, cols = t.core.slices()
        store.write(t, labels[rows, cols], None)
    default = threads.PIECE_PIXELS
    threads.PIECE_PIXELS = default if pieces else 1 << 62
    try:
        with RasterReader(image) as reader:
            t0 = time.perf_counter()
            finalize(store, folder / "out.tif", "cog", reader, NAMES, None, True, False)
            return time.perf_counter() - t0
    finally:
        threads.PIECE_PIXELS = default


def main(argv: list[str] | None = None) -> None:
    p = add_harness_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]),
                         "a 2048^2 scene, one alternation")
    p.add_argument("--repeats", type=int, default=0, help="alternations (default 3)")
    args = p.parse_args(argv)
    side = 2048 if args.quick else 8192
    repeats = args.repeats or (1 if args.quick else 3)
    image = synthetic_scene(DATA, side)
    labels = read_raster(image.with_name(f"scene{side}_mask.tif"))[0]
    cases = {"one_tile": side + 2 * 52, "grid": min(2048, side // 2)}
    load = [list(os.getloadavg())]
    figures: dict[str, Any] = {"side": side, "repeats": repeats, "classes": len(NAMES),
                               "threads": threads.thread_count(), "cases": {}}
    with tempfile.TemporaryDirectory(prefix="tail-", dir=DATA) as tmp:
        for way in (True, False):  # once each, unmeasured: the pool, GDAL, the mode table
            finalized(Path(tmp) / "warm", image, labels, cases["grid"], way)
        for case, tile in cases.items():
            seconds: dict[str, list[float]] = {"pieces": [], "one_piece": []}
            for _ in range(repeats):
                cogs = {}
                for way in seconds:
                    folder = Path(tmp) / way
                    seconds[way].append(round(finalized(folder, image, labels, tile,
                                                        way == "pieces"), 3))
                    cogs[way] = (folder / "out.tif").read_bytes()
                assert cogs["pieces"] == cogs["one_piece"], f"{case}: the COGs differ"
            figures["cases"][case] = {
                "tile_size": tile, **{f"{k}_s": v for k, v in seconds.items()},
                "same_bytes": True,
                "speedup": round(min(seconds["one_piece"]) / min(seconds["pieces"]), 2)}
    load.append(list(os.getloadavg()))
    figures["load_avg"] = load
    save("bench_finalize_tail", figures, args.out)


if __name__ == "__main__":
    main()
