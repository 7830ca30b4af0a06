"""``torch.compile`` against the eager network: per forward, per compile, and on the file path.

    .venv/bin/python experiments/bench_compile.py            # ~3 min on 2 cores
    .venv/bin/python experiments/bench_compile.py --quick    # small sizes (smoke)
    python experiments/bench_compile.py --device cuda --out .../bench_compile_gpu.json

The demo's U-Net (4 levels, width 16, same padding), channels-last, in the exact fp32 path
and the fast bf16 path:

1. ``forward``: the input shape ``tile_size=auto`` gives most often on an 8192^2 scene on
   this machine; the eager and the compiled forward alternated (``speedup``: best against
   best of ``--repeats``; ``speedup_median``: median against median), the
   compile's seconds (the first compiled call minus a compiled forward, with inductor's
   on-disk cache empty, as the first time on a machine), the two outputs
   compared bit for bit, and ``pays_after``: the forwards of that shape after which the
   compile has paid for itself (what ``compile=auto`` weighs).
2. ``file`` (fp32): ``predict_raster`` of a 4-band uint8 scene to a COG three ways:
   ``compile=false``; ``compile=auto`` as a user runs it (a shape is tried when its eager
   forwards left take 30 s: not on this scene here); and ``trial``, ``auto`` as on a job
   large enough for a trial of every shape with forwards left (compiled, checked, timed
   alternating with eager). The model seconds of each, what was measured per shape, and
   the outputs' labels compared pixel by pixel.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import seg_at_scale.cli  # noqa: F401 - before torch: huge pages for torch's tensors, as the commands run

# isort: split
import numpy as np
import torch
from common import add_harness_args, save, skip

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


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def forward(net: torch.nn.Module, shape: tuple[int, int, int], fast: bool,
            repeats: int) -> dict[str, Any]:
    """Eager against compiled on one input shape."""
    torch.manual_seed(0)
    device = next(net.parameters()).device
    x = torch.randn(shape[0], 4, shape[1], shape[2], device=device).contiguous(
        memory_format=torch.channels_last)
    ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=fast)
    compile_choice.reset()
    compiled = compile_choice.compiler(net)
    eager_s, compiled_s = [], []
    with torch.inference_mode(), ctx:
        ye = net(x)  # warm: oneDNN / cuDNN choose their kernels once per shape
        t0 = _clock(device)
        yc = compiled(x)
        first = _clock(device) - t0
        for _ in range(repeats):
            t0 = _clock(device)
            net(x)
            eager_s.append(round(_clock(device) - t0, 4))
            t0 = _clock(device)
            compiled(x)
            compiled_s.append(round(_clock(device) - t0, 4))
    e, c = min(eager_s), min(compiled_s)
    compile_s = first - c
    return {"shape": list(x.shape), "eager_s": eager_s, "compiled_s": compiled_s,
            "speedup": round(e / c, 3),
            "speedup_median": round(statistics.median(eager_s) / statistics.median(compiled_s),
                                    3),
            "compile_s": round(compile_s, 2),
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
    trial = compile_choice.TRIAL_S
    for name, mode in (("false", False), ("auto", "auto"), ("trial", "auto")):
        os.environ["SEG_AT_SCALE_CACHE"] = str(tmp / f"cache-{name}")
        compile_choice.TRIAL_S = 0.0 if name == "trial" else trial
        compile_choice.reset()  # a process of its own, as seg-predict is
        target = tmp / f"out-{name}.tif"
        stats = predict_raster(net, image, target, PredictOptions(
            tile_size=tile, fast=fast, compile=mode, layout="channels_last", preview=False,
            stac=False, progress=False, overwrite=True))
        out[name] = {"model_s": round(stats.model_s, 2), "seconds": round(stats.total_s, 2)}
        labels[name] = read_raster(target)[0]
    compile_choice.TRIAL_S = trial
    path = tmp / "cache-trial" / compile_choice.CACHE_NAME
    entries = list(json.loads(path.read_text()).values()) if path.exists() else []
    out["shapes"] = [{"shape": json.loads(e["shape"])[0], "equal": e.get("equal"),
                      "eager_s": e.get("eager_s"), "compiled_s": e.get("compiled_s"),
                      "compile_s": e.get("compile_s")} for e in entries]
    out["labels_equal"] = all(np.array_equal(labels["false"], v) for v in labels.values())
    for name in ("auto", "trial"):
        out[f"{name}_over_false"] = round(out["false"]["model_s"] / out[name]["model_s"], 3)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="alternations per forward")
    ap.add_argument("--side", type=int, default=4096, help="the file path's scene side")
    ap.add_argument("--tile", type=int, default=1024, help="the file path's tile_size")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (forwards only on cuda)")
    add_harness_args(ap, "256 px forwards, a 512^2 scene in 256 px tiles, one alternation")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.side, args.tile = 1, 512, 256
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return skip("needs CUDA for --device cuda")
    net = make_model("same", levels=4, width=16).to(device, memory_format=torch.channels_last)
    figures: dict[str, Any] = {"what": "torch.compile vs the eager network: per forward at "
                               "the tile_size=auto shape (fp32, bf16; first compile with "
                               "inductor's cache empty; bits compared) and seg-predict's "
                               "file path with compile=false / auto / a trial of every "
                               "shape (labels compared)",
                               "network": "UNet levels 4, width 16, same padding",
                               "device": torch.cuda.get_device_name(device)
                               if device.type == "cuda" else "cpu",
                               "threads": torch.get_num_threads(),
                               "trial_s": compile_choice.TRIAL_S}
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as name:
        # inductor's on-disk cache empty: every compile here is a first one (as on a new
        # machine or torch); later processes compile the same shapes from the cache
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(name) / "inductor")
        for label, fast in PRECISIONS.items():
            shape = (1, 256, 256) if args.quick else common_shape(net, 8192, fast)
            figures[f"forward_{label}"] = forward(net, shape, fast, args.repeats)
        if device.type == "cpu":
            figures["file_fp32"] = file_path(Path(name), net, args.side, args.tile, False)
    save("bench_compile", figures, args.out)


if __name__ == "__main__":
    main()
