"""Exact tiles of Unet-ResNet34 per tile side and per cuDNN algorithm choice, against MONAI.

    python experiments/bench_tile_rate.py --device cuda    # ~2 min on an H200
    .venv/bin/python experiments/bench_tile_rate.py --quick  # small sizes on the CPU (smoke)

Why the exact path loses to MONAI's sliding window in fp32 on a GPU (``bench_gpu.py``'s
``encoders``: Unet-ResNet34 at 8192^2, exact tiles of 4096 0.51x MONAI 512/0.25, the whole
image 0.45x, although their halo costs only E = 1.60 against MONAI's 1.78): whether the
convolutions of a large tile run slower per pixel than MONAI's batches of 512^2 windows, and
whether cuDNN's own measurement of its algorithms (``torch.backends.cudnn.benchmark``)
changes that. Unet-ResNet34 (smp, 4 bands, 5 classes, seeded weights, BatchNorm calibrated
as ``bench_encoders.py`` does) on a device-resident ``side``^2 scene normalised as
``(x / 255 - 0.5) / 0.25``, fp32 with TF32 off, NCHW: the whole image and exact tiles
(``predict_tiled_exact``) of each ``--tiles`` side, and MONAI's Gaussian sliding window
512/0.25 (``sw_batch_size=4``), each with ``cudnn.benchmark`` off and on; best of
``--repeats`` after a first call (its seconds: ``first_s``; its logits give the labels,
taken channels-last, outside the timing). Per run: Mpix/s, the rate of the pixels the network
computes (``E`` times the scene's: the work's own speed, halo included), and the % of labels
off the whole image's labels with the benchmark off; for tiles, how many input shapes the
grid gives the network. Then ``new_shape``: what the first forward of a shape not run
before costs beside the forward (three shapes near 1024^2). The JSON is rewritten after
every run, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Callable
from typing import Any

import torch
from bench_encoders import NORM, calibrated
from common import add_harness_args, save
from gpu_common import precision, timed

from seg_at_scale.data.synthetic import SceneGenerator
from seg_at_scale.tiling import Window, make_grid, predict_full
from seg_at_scale.tiling.statistic_passes import predict_tiled_exact

MODEL = "unet_resnet34"


def main(argv: list[str] | None = None) -> None:
    parser = add_harness_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]),
                              "Unet on timm's test_resnet, a 768^2 scene, tiles of 704, "
                              "on the CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--side", type=int, default=8192)
    parser.add_argument("--tiles", default="3072,4096,6144",
                        help="tile sides, the halo included (Unet-ResNet34's: 513)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    model, spec = MODEL, None
    if args.quick:
        args.side, args.tiles, args.repeats = 768, "704", 1
        model, spec = "unet_test_resnet", ("Unet", "tu-test_resnet")
    dev = torch.device(args.device)
    side, tiles = args.side, [int(t) for t in args.tiles.split(",")]
    raw = SceneGenerator(seed=0, height=side, width=side, bands=4).render(
        Window(0, 0, side, side))[0]
    x = torch.from_numpy(NORM(raw))[None].to(dev)
    net = calibrated(model, x, spec)
    fp = net.footprint()
    figures: dict[str, Any] = {"model": model, "side": side, "device": str(dev),
                               "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda"
                               else None, "halo": fp.halo, "repeats": args.repeats,
                               "precision": "fp32, TF32 off, NCHW", "runs": {}}
    path = args.out
    out: list[torch.Tensor] = []
    ref: dict[str, torch.Tensor] = {}

    def run(name: str, efficiency: float, fn: Callable[[], torch.Tensor]) -> None:
        with torch.inference_mode(), precision("fp32", dev):
            (first,) = timed(lambda: out.append(fn()), dev, 1, warmup=0)  # cuDNN's trials
            # the labels where the logits are: channels-last, so that the argmax runs along
            # a pixel's classes (along NCHW's planes the host took 6 s for 8192^2 x 5)
            labels = out.pop().contiguous(memory_format=torch.channels_last).argmax(1).cpu()
            best = min(timed(fn, dev, args.repeats, warmup=0))
        ref.setdefault("labels", labels)
        off = float((labels != ref["labels"]).float().mean()) * 100
        mpix = side * side / 1e6 / best
        figures["runs"][name] = {"s": round(best, 4), "first_s": round(first, 3),
                                 "mpix_per_s": round(mpix, 3), "E": round(efficiency, 4),
                                 "computed_mpix_per_s": round(mpix * efficiency, 3),
                                 "labels_off_pct": round(off, 4)}
        print(f"{name}: {figures['runs'][name]}", flush=True)
        with contextlib.redirect_stdout(io.StringIO()):  # kept if the run is cut short
            save("bench_tile_rate", figures, path)

    try:
        from monai.inferers import sliding_window_inference
    except ImportError:
        sliding_window_inference = None
    for bench in (False, True):
        torch.backends.cudnn.benchmark = bench
        mode = "benchmark" if bench else "heuristic"
        run(f"whole_{mode}", 1.0, lambda: predict_full(net, x))
        for t in tiles:
            grid = make_grid(side, side, fp, tile_size=t)
            run(f"tiles_{t}_{mode}", grid.efficiency,
                lambda t=t: predict_tiled_exact(net, x, tile_size=t, fp=fp))
            figures["runs"][f"tiles_{t}_{mode}"]["input_shapes"] = len(
                {(tile.read.height, tile.read.width) for tile in grid})
        if sliding_window_inference is not None:
            w = min(512, side // 2)
            run(f"monai_{w}_0.25_{mode}", 1 / 0.75**2, lambda w=w: sliding_window_inference(
                x, (w, w), 4, net, overlap=0.25, mode="gaussian", padding_mode="constant",
                cval=0.0))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    torch.backends.cudnn.benchmark = False
    figures["new_shape"] = new_shape_cost(net, dev, 256 if args.quick else 1024, fp.align)
    print(f"new_shape: {figures['new_shape']}", flush=True)
    runs = figures["runs"]
    for mode in ("heuristic", "benchmark"):
        theirs = runs.get(f"monai_{min(512, side // 2)}_0.25_{mode}", {}).get("mpix_per_s")
        if theirs:
            figures[f"vs_monai_{mode}"] = {k: round(v["mpix_per_s"] / theirs, 3)
                                           for k, v in runs.items() if k.endswith(mode)
                                           and not k.startswith("monai")}
    print(save("bench_tile_rate", figures, path))


def new_shape_cost(net: torch.nn.Module, dev: torch.device, side: int,
                   align: int) -> dict[str, Any]:
    """The first forward of an input shape the process has not run, less the second.

    Three shapes a step of ``align`` apart (a tiled grid's edge tiles differ so): what
    each new shape costs once, beside the forward itself.
    """
    extra = []
    with torch.inference_mode(), precision("fp32", dev):
        for k in range(3):
            x = torch.zeros(1, 4, side + k * align, side, device=dev)
            first, second = timed(lambda x=x: net(x), dev, 2, warmup=0)
            extra.append(first - second)
    return {"side": side, "first_minus_second_s": [round(e, 4) for e in extra],
            "median_s": round(sorted(extra)[1], 4)}


if __name__ == "__main__":
    main()
