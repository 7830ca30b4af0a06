"""Streamed seamless polygons vs ``rasterio.features.shapes`` on the whole array.

Run it::

    python experiments/bench_vectors.py                  # 10000^2 and 20000^2
    python experiments/bench_vectors.py --sizes 2000     # a quick look

For each size a synthetic scene's label raster (``SceneGenerator(seed=1).render_mask``,
rendered and written strip by strip: a tiled zlib GeoTIFF, EPSG:32633, 1 m pixels) is
polygonized to a GeoPackage twice, each in a fresh process whose peak RSS the kernel reports
(``wait4``):

* **streamed**: :func:`seg_at_scale.vectors.write_vectors` (4-connectivity, default strips);
* **peer**: the whole array read into memory, ``rasterio.features.shapes`` over it,
  ``GeoDataFrame.from_features(...).to_file(...)``: what one does without this package.

Then the two files are compared: feature counts per class, and every polygon paired with
exactly one of the other side with a symmetric-difference area of 0 (up to 1e-6 m²).
The streamed figure also gets a ``simplify`` run (coverage simplification holds every
polygon) at the smallest size. Each process's import alone is measured too: importing
``seg_at_scale`` imports torch (``seg_at_scale.tiling``), which is most of the streamed
process's baseline. The load average is recorded: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["background", "vegetation", "water", "road", "building"]


# -- children ------------------------------------------------------------------------------

def child(mode: str, labels: str, out: str) -> dict:
    """Run one measured job in this (fresh) process; return its figures."""
    if mode == "import_streamed":
        import seg_at_scale.vectors.write  # noqa: F401
        return {}
    if mode == "import_peer":
        import geopandas  # noqa: F401
        import rasterio.features  # noqa: F401
        return {}
    if mode.startswith("streamed"):
        from seg_at_scale.vectors import write_vectors

        simplify = 1.0 if mode == "streamed_simplify" else 0.0
        stats = write_vectors(labels, out, class_names=NAMES, overwrite=True, simplify=simplify)
        return {"seconds": round(stats.seconds, 2), "features": stats.features,
                "strips": stats.strips, "peak_open_regions": stats.peak_open_regions,
                "peak_open_pieces": stats.peak_open_pieces}
    return peer(labels, out)


def peer(labels: str, out: str) -> dict:
    """The whole array in memory, GDAL's polygonizer over it, GeoPandas to write."""
    import geopandas as gpd
    import rasterio
    import rasterio.features

    t0 = time.perf_counter()
    with rasterio.open(labels) as ds:
        array, transform, crs = ds.read(1), ds.transform, ds.crs
    t1 = time.perf_counter()
    shapes = list(rasterio.features.shapes(array, mask=array != 255, connectivity=4,
                                           transform=transform))
    t2 = time.perf_counter()
    features = [{"type": "Feature", "geometry": g, "properties": {"class_id": int(v)}}
                for g, v in shapes]
    frame = gpd.GeoDataFrame.from_features(features, crs=crs)
    frame["class_name"] = [NAMES[c] for c in frame.class_id]
    frame.to_file(out, driver="GPKG")
    t3 = time.perf_counter()
    return {"seconds": round(t3 - t0, 2), "read_s": round(t1 - t0, 2),
            "shapes_s": round(t2 - t1, 2), "write_s": round(t3 - t2, 2),
            "features": frame.class_name.value_counts().to_dict()}


def measured(mode: str, labels: Path | str = "", out: Path | str = "") -> dict:
    """Run ``child(mode, ...)`` in a fresh interpreter; add its wall time and peak RSS."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'experiments'}"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--child", mode, str(labels), str(out)],
                            stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    text = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak, in KiB
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{mode} failed with exit code {proc.returncode}")
    return {**json.loads(text.strip().splitlines()[-1]),
            "wall_s": round(time.perf_counter() - t0, 2),
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}


# -- inputs and comparison -----------------------------------------------------------------

def make_scene(path: Path, side: int) -> float:
    """The scene's labels as a tiled GeoTIFF, rendered and written 512 rows at a time."""
    from seg_at_scale.data.synthetic import SceneGenerator
    from seg_at_scale.io import example_geotags, write_raster_bands
    from seg_at_scale.tiling import Window

    gen = SceneGenerator(1, side, side)
    bands = (gen.render_mask(Window(r, 0, min(512, side - r), side))[None]
             for r in range(0, side, 512))
    t0 = time.perf_counter()
    write_raster_bands(path, (1, side, side), np.uint8, bands, tile=(512, 512),
                       compression="zlib", geotags=example_geotags(), nodata=255)
    return round(time.perf_counter() - t0, 1)


def compare(streamed: Path, reference: Path) -> dict:
    """Counts per class, and every polygon paired one-to-one with an equal one."""
    import geopandas as gpd
    import shapely

    t0 = time.perf_counter()
    mine, ref = gpd.read_file(streamed), gpd.read_file(reference)
    figures: dict = {"counts_equal": mine.class_id.value_counts().sort_index().tolist()
                     == ref.class_id.value_counts().sort_index().tolist(),
                     "compared": 0, "unmatched": 0, "max_symmetric_difference_m2": 0.0}
    for cls in sorted(set(ref.class_id)):
        want = shapely.make_valid(ref.geometry[ref.class_id == cls].to_numpy())
        have = mine.geometry[mine.class_id == cls].to_numpy()
        i, j = shapely.STRtree(have).query(shapely.point_on_surface(want),
                                           predicate="intersects")
        diff = shapely.area(shapely.symmetric_difference(want[i], have[j]))
        ok = diff <= 1e-6
        matched = np.bincount(i[ok], minlength=len(want))
        figures["compared"] += len(want)
        figures["unmatched"] += int((matched != 1).sum())
        figures["max_symmetric_difference_m2"] = max(
            figures["max_symmetric_difference_m2"], float(diff[ok].max(initial=0.0)))
    figures["identical"] = figures["counts_equal"] and figures["unmatched"] == 0
    figures["seconds"] = round(time.perf_counter() - t0, 1)
    return figures


def versions() -> dict:
    import geopandas
    import pyogrio
    import rasterio
    import scipy
    import shapely

    return {"python": platform.python_version(), "numpy": np.__version__,
            "scipy": scipy.__version__, "rasterio": rasterio.__version__,
            "gdal": rasterio.__gdal_version__, "shapely": shapely.__version__,
            "geos": shapely.geos_version_string, "pyogrio": pyogrio.__version__,
            "geopandas": geopandas.__version__}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10000, 20000])
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smoke run: one 1000^2 scene")
    parser.add_argument("--out", type=Path, default=None,
                        help="result JSON (default experiments/results/bench_vectors.json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes = [1000]
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    load_before = os.getloadavg()
    figures: dict = {"versions": versions(), "imports": {
        "streamed": measured("import_streamed"), "peer": measured("import_peer")}, "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="bench_vectors_") as tmp:
        for n, side in enumerate(args.sizes):
            labels = Path(tmp) / f"labels_{side}.tif"
            row: dict = {"write_labels_s": make_scene(labels, side)}
            row["streamed"] = measured("streamed", labels, Path(tmp) / f"s_{side}.gpkg")
            row["peer"] = measured("peer", labels, Path(tmp) / f"p_{side}.gpkg")
            row["same_polygons"] = compare(Path(tmp) / f"s_{side}.gpkg",
                                           Path(tmp) / f"p_{side}.gpkg")
            if n == 0:
                row["streamed_simplify_1m"] = measured("streamed_simplify", labels,
                                                       Path(tmp) / f"q_{side}.gpkg")
            figures["sizes"][f"{side}x{side}"] = row
            print(json.dumps({side: row}, indent=1), flush=True)
    figures["load_average_before"] = [round(x, 2) for x in load_before]
    figures["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    from common import save  # imports torch: not in the measured children

    save("bench_vectors", figures, args.out)


if __name__ == "__main__":
    main()
