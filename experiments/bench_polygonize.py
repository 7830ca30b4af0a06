"""Polygonizing fragmented labels: :func:`seg_at_scale.vectors.polygonize` vs
``rasterio.features.shapes``, in one run (issue #39).

Run it::

    python experiments/bench_polygonize.py              # the figures below, ~2 minutes
    python experiments/bench_polygonize.py --before     # + the pre-#39 polygonizer, once
    python experiments/bench_polygonize.py --quick      # checkerboard 100^2 and noise only

Label patterns (uint8, no no-data), each polygonized with 4- and with 8-connectivity:

* **checkerboard** 100², 200², 300²: two classes alternating pixel by pixel; with
  8-connectivity each class is one region of n²/2 squares joined at corners (before #39,
  ``shapely.make_valid`` on that region took 61 s at 100² and over 600 s at 200²);
* **noise50** 300²: a smooth 5-class raster with half of its pixels replaced by a random
  class (before #39: 125 s with 8-connectivity);
* **smooth** 2048² (one strip) and 4096² (four strips at the default 4 Mpx a strip, so
  regions are stitched across seams): Gaussian-filtered noise cut into 5 classes.

Timings are the best of ``--repeats`` runs, wall and CPU (``time.process_time``: the machine
is shared, and both sides are single-threaded), with the reference run right before ours
each time. **rasterio** is ``list(rasterio.features.shapes(labels, connectivity=c))`` on the
whole array: GeoJSON-like dicts, the time the issue compared against. **ours** is
``list(polygonize(labels, connectivity=c))`` at the default strips; **ours_strips64** the same
streamed 64 rows a strip. Every run checks what it got: the same number of regions per
class as rasterio, pixels per class equal to the raster's, every geometry valid, and (all
4-connected cases, and the 8-connected ones up to 100² and the smooth ones) the same
polygons per class as rasterio's made valid, paired one to one with
``shapely.equals``. Saved to ``experiments/results/bench_polygonize.json`` with the commit,
machine and load average.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

#: The polygonizer before #39 (make_valid on each strip's regions, union_all across seams).
BEFORE = "64f7f0e"


def checkerboard(n: int) -> np.ndarray:
    return (np.add.outer(np.arange(n), np.arange(n)) % 2).astype(np.uint8)


def smooth(n: int, seed: int = 0) -> np.ndarray:
    from scipy import ndimage

    rng = np.random.default_rng(seed)
    field = ndimage.gaussian_filter(rng.random((n, n), np.float32), n / 100)
    edges = np.quantile(field, [0.2, 0.4, 0.6, 0.8])
    return np.digitize(field, edges).astype(np.uint8)


def noise50(n: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    labels = smooth(n, seed)
    hit = rng.random((n, n)) < 0.5
    labels[hit] = rng.integers(0, 5, int(hit.sum()), dtype=np.uint8)
    return labels


def cases(quick: bool) -> dict[str, np.ndarray]:
    if quick:
        return {"checkerboard_100": checkerboard(100), "noise50_300": noise50(300)}
    return {"checkerboard_100": checkerboard(100), "checkerboard_200": checkerboard(200),
            "checkerboard_300": checkerboard(300), "noise50_300": noise50(300),
            "smooth_2048": smooth(2048), "smooth_4096": smooth(4096)}


def timed(fn) -> tuple[float, float, object]:
    gc.collect()
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w0, time.process_time() - c0, out


def reference(labels: np.ndarray, connectivity: int) -> list:
    import rasterio.features

    return list(rasterio.features.shapes(labels, connectivity=connectivity))


def ours(labels: np.ndarray, connectivity: int, strip_rows: int | None = None) -> list:
    from seg_at_scale.vectors import polygonize

    return list(polygonize(labels, connectivity=connectivity, strip_rows=strip_rows))


def check(labels: np.ndarray, connectivity: int, ref: list, got: list, polygons: bool
          ) -> dict:
    """Counts per class, pixels per class, validity; and the polygons themselves."""
    import shapely
    from shapely.geometry import shape

    ref_count = np.bincount([int(v) for _, v in ref], minlength=256)
    got_count = np.bincount([r.class_id for r in got], minlength=256)
    pixels = np.bincount([r.class_id for r in got], weights=[r.pixels for r in got],
                         minlength=256)
    geoms = np.array([r.geometry for r in got], dtype=object)
    area = np.bincount([r.class_id for r in got], weights=shapely.area(geoms), minlength=256)
    out = {"regions": int(got_count.sum()),
           "counts_equal": bool((ref_count == got_count).all()),
           "pixels_equal": bool((pixels == np.bincount(labels.ravel(), minlength=256)).all()
                                and (area == pixels).all()),
           "all_valid": bool(shapely.is_valid(geoms).all())}
    if polygons:
        classes = np.array([r.class_id for r in got])
        same = True
        for cls in np.unique(classes):
            want = shapely.make_valid(np.array([shape(g) for g, v in ref if int(v) == cls],
                                               dtype=object))
            have = geoms[classes == cls]
            i, j = shapely.STRtree(have).query(shapely.point_on_surface(want),
                                               predicate="intersects")
            eq = shapely.equals(want[i], have[j])
            same &= bool((np.bincount(i[eq], minlength=len(want)) == 1).all()
                         and len(set(j[eq].tolist())) == len(want))
        out["same_polygons"] = same
    return out


def run_case(name: str, labels: np.ndarray, connectivity: int, repeats: int) -> dict:
    n = labels.shape[0]
    best: dict[str, list[float]] = {}
    ref = got = None
    strips64 = n <= 1000
    load_before = [round(x, 2) for x in os.getloadavg()]
    for _ in range(repeats):
        for key, fn in (("rasterio", lambda: reference(labels, connectivity)),
                        ("ours", lambda: ours(labels, connectivity)),
                        *((("ours_strips64", lambda: ours(labels, connectivity, 64)),)
                          if strips64 else ())):
            wall, cpu, out = timed(fn)
            old = best.get(key, [float("inf"), float("inf")])
            best[key] = [min(old[0], wall), min(old[1], cpu)]
            if key == "rasterio":
                ref = out
            elif key == "ours":
                got = out
            else:
                del out
    row: dict = {"size": list(labels.shape), "connectivity": connectivity,
                 "load_before": load_before}
    for key, (wall, cpu) in best.items():
        row[f"{key}_wall_s"] = round(wall, 3)
        row[f"{key}_cpu_s"] = round(cpu, 3)
    for key in best:
        if key != "rasterio":
            row[f"{key}_ratio_cpu"] = round(best[key][1] / best["rasterio"][1], 2)
            row[f"{key}_ratio_wall"] = round(best[key][0] / best["rasterio"][0], 2)
    polygons = connectivity == 4 or not name.startswith("checkerboard")
    row["check"] = check(labels, connectivity, ref, got, polygons)
    row["load_after"] = [round(x, 2) for x in os.getloadavg()]
    return row


def before(labels: np.ndarray, connectivity: int) -> dict:
    """The pre-#39 polygonizer (from git) once on ``labels``, timed."""
    import importlib.util
    import tempfile

    source = subprocess.run(["git", "show", f"{BEFORE}:seg_at_scale/vectors/polygonize.py"],
                            cwd=ROOT, check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "polygonize_before.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("polygonize_before", path)
        module = importlib.util.module_from_spec(spec)
        assert spec.loader is not None
        sys.modules[spec.name] = module  # its dataclasses look themselves up there
        spec.loader.exec_module(module)
    wall, cpu, out = timed(lambda: list(module.polygonize(labels, connectivity=connectivity)))
    return {"commit": BEFORE, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "regions": len(out)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke run: the small cases only")
    parser.add_argument("--before", action="store_true",
                        help="also time the pre-#39 polygonizer on checkerboard 100^2 and "
                             "noise50 300^2 with 8-connectivity (minutes)")
    parser.add_argument("--out", type=Path, default=None,
                        help="result JSON (default experiments/results/bench_polygonize.json)")
    args = parser.parse_args(argv)
    ours(checkerboard(8), 8)  # imports (scipy.sparse, shapely) out of the timings
    reference(checkerboard(8), 8)
    figures: dict = {"load_average_before": [round(x, 2) for x in os.getloadavg()],
                     "repeats": args.repeats, "cases": {}}
    worst = 0.0
    for name, labels in cases(args.quick).items():
        for connectivity in (4, 8):
            row = run_case(name, labels, connectivity, args.repeats)
            figures["cases"][f"{name}_c{connectivity}"] = row
            worst = max(worst, row["ours_ratio_cpu"])
            print(json.dumps({f"{name}_c{connectivity}": row}), flush=True)
    figures["worst_ratio_cpu"] = worst
    if args.before:
        figures["before"] = {}
        for name, labels in (("checkerboard_100", checkerboard(100)),
                             ("noise50_300", noise50(300))):
            figures["before"][f"{name}_c8"] = before(labels, 8)
            print(json.dumps({name: figures["before"][f"{name}_c8"]}), flush=True)
    figures["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    import rasterio
    import shapely

    figures["versions"] = {"rasterio": rasterio.__version__,
                           "gdal": rasterio.__gdal_version__, "shapely": shapely.__version__,
                           "geos": shapely.geos_version_string, "numpy": np.__version__}
    figures["polygonizer_commit"] = subprocess.run(
        ["git", "log", "-1", "--format=%h", "--", "seg_at_scale/vectors"], cwd=ROOT,
        capture_output=True, text=True).stdout.strip()
    from common import save  # imports torch: after the measurements

    save("bench_polygonize", figures, args.out)


if __name__ == "__main__":
    main()
