"""Windows across the image border: decoded into place, against gathered from a box.

    .venv/bin/python experiments/bench_window_fill.py            # the 8192^2 scene, 3 alternations
    .venv/bin/python experiments/bench_window_fill.py --quick    # 1024^2, one alternation (smoke)

A tile at the image border reads a window that reaches outside: zeros of the normalised
input there for ``same`` networks (``constant``), the image's reflection for ``valid`` ones
(``reflect``). ``RasterReader.read`` decodes the window's part inside the image straight
into the window and copies a reflection's margins from that part; the peer here is the
way it replaced: the box of every source pixel read, then gathered at ``source_indices``
into the window (a copy of the box for ``constant``; two passes of a fancy index over the
whole window for ``reflect``). Two reads of the 8192^2 4-band scene (256^2 zlib tiles,
pixel-interleaved, ``pixels=True`` as the tile engine reads): one window of the whole image
and a 52-pixel halo (what ``tile_size=auto`` gives a small network on a large GPU), and the
25 windows of the 2048 grid of the demo's U-Net (halo 46: case ``grid``). Each is
alternated with its peer from a fresh reader (the decoded-segment cache empty), both fills,
best of ``--repeats``; the outputs are compared for equality.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import as_commands  # noqa: F401 - before numpy's first big array: the commands' malloc

# isort: split
import numpy as np
from common import add_harness_args, save, synthetic_scene

from seg_at_scale.io import RasterReader
from seg_at_scale.io.raster import _take
from seg_at_scale.tiling import Footprint, make_grid
from seg_at_scale.tiling.geometry import Fill, Window, source_indices

DATA = Path(__file__).resolve().parents[1] / "data" / "bench" / "feed"  # bench_feed's scene


def gathered(reader: RasterReader, w: Window, fill: Fill) -> np.ndarray:
    """The definition: the box of every source pixel, gathered at ``source_indices``."""
    rows = source_indices(w.row, w.height, reader.height, fill)
    cols = source_indices(w.col, w.width, reader.width, fill)
    vr, vc = np.flatnonzero(rows >= 0), np.flatnonzero(cols >= 0)
    out = reader.layout.empty_box(w.height, w.width, 0, pixels=True)
    r0, r1 = int(rows[vr].min()), int(rows[vr].max()) + 1
    c0, c1 = int(cols[vc].min()), int(cols[vc].max()) + 1
    box = reader.read(Window(r0, c0, r1 - r0, c1 - c0), pixels=True)
    # a run of increasing indices is a view (constant fill): one copy, as the gather was
    out[:, vr[0] : vr[-1] + 1, vc[0] : vc[-1] + 1] = _take(_take(box, rows[vr] - r0, 1),
                                                         cols[vc] - c0, 2)
    return out


def timed(image: Path, windows: list[Window], fill: Fill, way: str) -> tuple[float, list[Any]]:
    with RasterReader(image) as reader:
        t0 = time.perf_counter()
        outs = [reader.read(w, fill=fill, pixels=True) if way == "in_place"
                else gathered(reader, w, fill) for w in windows]
        return time.perf_counter() - t0, outs


def main(argv: list[str] | None = None) -> None:
    p = add_harness_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]),
                         "a 1024^2 scene, one alternation")
    p.add_argument("--repeats", type=int, default=0, help="alternations (default 3)")
    args = p.parse_args(argv)
    side = 1024 if args.quick else 8192
    repeats = args.repeats or (1 if args.quick else 3)
    image = synthetic_scene(DATA, side)
    halo = 52
    tile = min(2048, side // 2)
    grid = make_grid(side, side, Footprint(46, 8, "same"), tile_size=tile, uniform=True)
    reads = {"whole_image": [Window(-halo, -halo, side + 2 * halo, side + 2 * halo)],
             "grid": [t.read for t in grid.tiles]}
    load = [list(os.getloadavg())]
    figures: dict[str, Any] = {"side": side, "repeats": repeats, "halo": halo,
                               "grid_tile_size": tile, "cases": {}}
    for case, windows in reads.items():
        fills: tuple[Fill, ...] = ("constant", "reflect")
        for fill in fills:
            seconds: dict[str, list[float]] = {"in_place": [], "gathered": []}
            for _ in range(repeats):
                outs = {}
                for way in seconds:
                    s, outs[way] = timed(image, windows, fill, way)
                    seconds[way].append(round(s, 3))
                same = all(np.array_equal(a, b) for a, b in zip(*outs.values(), strict=True))
                assert same, f"{case} {fill}: the two reads differ"
                del outs
            figures["cases"][f"{case}_{fill}"] = {
                "windows": len(windows), "megapixels": round(
                    sum(w.height * w.width for w in windows) / 1e6, 1),
                **{f"{k}_s": v for k, v in seconds.items()}, "same": True,
                "speedup": round(min(seconds["gathered"]) / min(seconds["in_place"]), 2)}
    load.append(list(os.getloadavg()))
    figures["load_avg"] = load
    save("bench_window_fill", figures, args.out)


if __name__ == "__main__":
    main()
