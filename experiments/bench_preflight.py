"""What the preflight costs, against one demo epoch; and window reads of a single strip.

Run it::

    python experiments/bench_preflight.py            # demo data + a 20000^2 scene under data/
    python experiments/bench_preflight.py --quick --out /tmp/r.json   # 256^2 scenes, seconds

1. Preflight of the demo data (8 + 2 + 1 scenes of 1024^2, uint8) and of one 20000^2
   4-band uint8 tiled scene: cold (no cache: headers + a full pass over every mask) and
   warm (pixel facts from the cache: headers only), plus the ``data.scale=auto`` sample.
2. One demo epoch (training + validation): ``seg-train`` for 3 epochs with a callback that
   notes when each epoch starts; the median gap between epoch starts.
3. Reading every 512^2 window of a 20000 x 1024 4-band file stored as one uncompressed
   strip (memory-mapped now; and the old way, decoding the whole strip per window, in the
   same run) vs the same pixels tiled + zlib: seconds and bytes read.

The load average is recorded: the machine is shared, and only ratios within a run compare.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import tifffile
from common import add_harness_args, save

from seg_at_scale.data.band_stats import sample_sums
from seg_at_scale.data.preflight import CACHE_NAME, preflight
from seg_at_scale.data.sources.synthetic import make_dataset, write_scene
from seg_at_scale.data.synthetic import SceneGenerator
from seg_at_scale.io import RasterReader
from seg_at_scale.tiling import Window

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
DEMO = DATA / "synthetic_1024x1024_s0"


def timed_preflight(root: Path, splits: list[str]) -> dict[str, float]:
    """Cold (cache removed) and warm preflight seconds; the auto-scale sample's seconds."""
    (root / CACHE_NAME).unlink(missing_ok=True)
    kw = {"bands": 4, "num_classes": 5, "scale": 1 / 255, "cache": root / CACHE_NAME}
    t0 = time.perf_counter()
    report = preflight(root, splits, **kw)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm_report = preflight(root, splits, **kw)
    warm = time.perf_counter() - t0
    assert warm_report.checked == 0
    t0 = time.perf_counter()
    for scene in report.scenes["train"]:
        with RasterReader(scene.image) as r:
            sample_sums(r)
    return {"cold_s": round(cold, 3), "warm_s": round(warm, 3),
            "auto_scale_sample_s": round(time.perf_counter() - t0, 3),
            "files": 2 * sum(len(v) for v in report.scenes.values()),
            "megapixels": round(sum(h * w for h, w in report.shapes.values()) / 1e6, 1)}


def big_scene(side: int = 20000, data: Path = DATA) -> Path:
    """A ``side^2`` 4-band uint8 tiled scene (+ mask) under ``data``, written once."""
    root = data / f"preflight_{side}"
    image = root / "train" / "scene_0_image.tif"
    if not image.exists():
        (root / "train").mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        write_scene(image, root / "train" / "scene_0_mask.tif", SceneGenerator(1, side, side),
                    tile=(512, 512), compression="zlib")
        print(f"wrote {image} in {time.perf_counter() - t0:.1f} s")
    return root


class EpochClock(pl.Callback):
    """Appends the wall time of every epoch start to ``$BENCH_EPOCH_LOG`` (one per line)."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with open(os.environ["BENCH_EPOCH_LOG"], "a") as f:
            f.write(f"{time.time()}\n")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.on_train_epoch_start(trainer, pl_module)


def demo_epoch_s(epochs: int = 3, data: Path = DATA, overrides: tuple[str, ...] = ()
                 ) -> dict[str, object]:
    """Seconds per demo epoch (training + validation), timed inside one ``seg-train`` run."""
    with tempfile.TemporaryDirectory() as run:
        stamps = Path(run) / "epochs.txt"
        cmd = [sys.executable, "-m", "seg_at_scale.cli.train", f"hydra.run.dir={run}/run",
               f"trainer.max_epochs={epochs}", "predict_after_fit=false", "logger=csv",
               "trainer.enable_progress_bar=false",
               "+callbacks.clock._target_=bench_preflight.EpochClock", *overrides]
        path = os.pathsep.join([str(ROOT), str(ROOT / "experiments")])
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT,
                       env={**os.environ, "SEG_DATA_DIR": str(data), "PYTHONPATH": path,
                            "BENCH_EPOCH_LOG": str(stamps)})
        times = [float(t) for t in stamps.read_text().split()]
    gaps = np.diff(times)
    return {"one_epoch_s": round(float(np.median(gaps)), 2),
            "epochs_s": [round(float(g), 2) for g in gaps]}


def strip_reads(height: int = 20000, width: int = 1024, side: int = 512) -> dict[str, object]:
    """Every ``side^2`` window of one raw strip (mapped) vs tiled zlib: time, bytes read."""
    pixels = SceneGenerator(2, height, width).render(Window(0, 0, height, width))[0]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        strip, tiled = Path(tmp) / "strip.tif", Path(tmp) / "tiled.tif"
        tifffile.imwrite(strip, np.moveaxis(pixels, 0, -1), rowsperstrip=height,
                         photometric="rgb", extrasamples=[0])
        tifffile.imwrite(tiled, np.moveaxis(pixels, 0, -1), tile=(512, 512), compression="zlib",
                         photometric="rgb", extrasamples=[0])
        windows = [Window(r, c, min(side, height - r), min(side, width - c))
                   for r in range(0, height, side) for c in range(0, width, side)]
        for name, path in (("single_strip_raw", strip), ("single_strip_decoded_whole", strip),
                           ("tiled_zlib", tiled)):
            with RasterReader(path) as reader:
                if name == "single_strip_decoded_whole":  # the old way: no memory map
                    reader.layout = dataclasses.replace(reader.layout, contiguous=None)
                t0 = time.perf_counter()
                for w in windows:
                    reader.read(w)
                out[name] = {"seconds": round(time.perf_counter() - t0, 3),
                             "mb_read": round(reader.bytes_read / 1e6, 1),
                             "mapped": reader.layout.contiguous is not None}
    out["windows"] = len(windows)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_harness_args(p, "256^2 demo scenes (2 + 1 + 1), a 2000^2 scene, 2 epochs, 2000-row strip")
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    side, big_side, strip_rows, epochs, overrides = 1024, 20000, 20000, 3, ()
    data, splits = DATA, {"train": 8, "val": 2, "test": 1}
    tmp = None
    if args.quick:
        tmp = tempfile.TemporaryDirectory(prefix="bench_preflight_")
        side, big_side, strip_rows, epochs, data = 256, 2000, 2000, 2, Path(tmp.name)
        splits = {"train": 2, "val": 1, "test": 1}
        overrides = ("data.synthetic.height=256", "data.synthetic.width=256",
                     "data.synthetic.splits={train:2,val:1,test:1}",
                     "tiling.samples_per_epoch=16")
    demo_root = data / f"synthetic_{side}x{side}_s0"
    make_dataset(demo_root, splits=splits, height=side, width=side, seed=0)
    demo = timed_preflight(demo_root, ["train", "val", "test"])
    big = timed_preflight(big_scene(big_side, data), ["train"])
    epoch = demo_epoch_s(epochs, data, overrides)
    reads = strip_reads(strip_rows)
    if tmp is not None:
        tmp.cleanup()
    figures = {
        "quick": args.quick,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "demo": demo, "scene_20000": big, "demo_epoch": epoch,
        "fraction_of_demo_epoch": {
            "demo_cold": round(demo["cold_s"] / epoch["one_epoch_s"], 4),
            "demo_warm": round(demo["warm_s"] / epoch["one_epoch_s"], 4),
            "scene_20000_cold": round(big["cold_s"] / epoch["one_epoch_s"], 3),
            "scene_20000_warm": round(big["warm_s"] / epoch["one_epoch_s"], 4)},
        "strip_reads_20000x1024": reads,
    }
    save("bench_preflight", figures, args.out)


if __name__ == "__main__":
    main()
