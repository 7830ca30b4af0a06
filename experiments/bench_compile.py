"""``torch.compile`` against the eager network: per forward, per compile, and on the file path.

    .venv/bin/python experiments/bench_compile.py            # ~3 min on 2 cores
    .venv/bin/python experiments/bench_compile.py --quick    # small sizes (smoke)

The demo's U-Net (4 levels, width 16, same padding), channels-last, in the exact fp32 path
and the fast bf16 path:

1. ``forward``: the input shape ``tile_size=auto`` gives most often on an 8192^2 scene on
   this machine; the eager and the compiled forward alternated (best of ``--repeats``), the
   compile's seconds (the first compiled call minus a compiled forward), the two outputs
   compared bit for bit, and ``pays_after``: the forwards of that shape after which the
   compile has paid for itself (what ``compile=auto`` weighs).
2. ``file``: ``predict_raster`` of a 4-band uint8 scene to a COG, ``compile=false`` against
   ``compile=auto`` as on a scene large enough for a trial (every shape with forwards left
   is compiled and checked); the model seconds of each, the shapes compiled, and the two
   outputs' labels compared pixel by pixel.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import seg_at_scale.cli  # noqa: F401 - before torch: huge pages for torch's tensors, as the commands run

# isort: split
import numpy as np
import torch
from common import add_harness_args, save

from seg_at_scale.io import read_raster
from seg_at_scale.prediction import PredictOptions, compile_choice, predict_raster
from seg_at_scale.prediction.plan import with_tile
from seg_at_scale.tiling import footprint, make_grid
from seg_at_scale.tiling.engine import forward_shapes, plan_batches

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from helpers.prediction import make_image, make_model  # noqa: E402

PRECISIONS = {"fp32": False, "bf16": True}


def common_shape(net: torch.nn.Module, side: int, fast: bool) -> tuple[int, int, int]:
    """The ``(batch, h, w)`` forward ``tile_size=auto`` makes most often on a side^2 scene."""
    fp = footprint(net)
    options = with_tile(PredictOptions(fast=fast), net, fp, 4, side, side)
    grid = make_grid(side, side, fp, tile_size=options.tile_size, uniform=True)
    shapes = forward_shapes(plan_batches(grid.tiles, options.batch_size or 1), height=side,
                            width=side, fp=fp)
    return shapes.most_common(1)[0][0]


def forward(net: torch.nn.Module, shape: tuple[int, int, int], fast: bool,
            repeats: int) -> dict[str, Any]:
    """Eager against compiled on one input shape."""
    torch.manual_seed(0)
    x = torch.randn(shape[0], 4, shape[1], shape[2]).contiguous(
        memory_format=torch.channels_last)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=fast)
    compile_choice.reset()
    compiled = compile_choice.compiler(net)
    eager_s, compiled_s = [], []
    with torch.inference_mode(), ctx:
        ye = net(x)  # warm: oneDNN makes its kernels once per shape
        t0 = time.perf_counter()
        yc = compiled(x)
        first = time.perf_counter() - t0
        for _ in range(repeats):
            t0 = time.perf_counter()
            net(x)
            eager_s.append(round(time.perf_counter() - t0, 4))
            t0 = time.perf_counter()
            compiled(x)
            compiled_s.append(round(time.perf_counter() - t0, 4))
    e, c = min(eager_s), min(compiled_s)
    compile_s = first - c
    return {"shape": list(x.shape), "eager_s": eager_s, "compiled_s": compiled_s,
            "speedup": round(e / c, 3), "compile_s": round(compile_s, 2),
            "equal_bits": bool(torch.equal(ye, yc)),
            "pays_after": None if c >= e else int(np.ceil(compile_s / (e - c)))}


def file_path(tmp: Path, net: torch.nn.Module, side: int, tile: int, fast: bool
              ) -> dict[str, Any]:
    """``predict_raster``: compile=false against compile=auto (every shape worth a trial)."""
    image = tmp / f"scene{side}.tif"
    if not image.exists():
        make_image(image, side, side)
    out: dict[str, Any] = {"side": side, "tile_size": tile}
    labels = {}
    for mode in (False, "auto"):
        os.environ["SEG_AT_SCALE_CACHE"] = str(tmp / f"cache-{fast}")
        compile_choice.TRIAL_S = 0.0 if mode == "auto" else compile_choice.TRIAL_S
        compile_choice.reset()  # a process of its own, as seg-predict is
        target = tmp / f"out-{mode}-{fast}.tif"
        stats = predict_raster(net, image, target, PredictOptions(
            tile_size=tile, fast=fast, compile=mode, layout="channels_last", preview=False,
            stac=False, progress=False, overwrite=True))
        out[f"compile_{mode}".lower()] = {"model_s": round(stats.model_s, 2),
                                          "seconds": round(stats.total_s, 2)}
        labels[mode] = read_raster(target)[0]
    path = tmp / f"cache-{fast}" / compile_choice.CACHE_NAME
    entries = list(json.loads(path.read_text()).values()) if path.exists() else []
    out["shapes"] = [{"shape": json.loads(e["shape"])[0], "equal": e.get("equal"),
                      "eager_s": e.get("eager_s"), "compiled_s": e.get("compiled_s"),
                      "compile_s": e.get("compile_s")} for e in entries]
    out["labels_equal"] = bool(np.array_equal(labels[False], labels["auto"]))
    out["model_ratio"] = round(out["compile_false"]["model_s"] / out["compile_auto"]["model_s"],
                               3)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="alternations per forward")
    ap.add_argument("--side", type=int, default=4096, help="the file path's scene side")
    ap.add_argument("--tile", type=int, default=1024, help="the file path's tile_size")
    add_harness_args(ap, "256 px forwards, a 512^2 scene in 256 px tiles, one alternation")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.side, args.tile = 1, 512, 256
    net = make_model("same", levels=4, width=16).to(memory_format=torch.channels_last)
    trial = compile_choice.TRIAL_S
    figures: dict[str, Any] = {"network": "UNet levels 4, width 16, same padding",
                               "threads": torch.get_num_threads(), "trial_s": trial}
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as name:
        for label, fast in PRECISIONS.items():
            shape = (1, 256, 256) if args.quick else common_shape(net, 8192, fast)
            figures[f"forward_{label}"] = forward(net, shape, fast, args.repeats)
            figures[f"file_{label}"] = file_path(Path(name), net, args.side, args.tile, fast)
            compile_choice.TRIAL_S = trial
    save("bench_compile", figures, args.out)


if __name__ == "__main__":
    main()
