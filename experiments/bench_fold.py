"""BatchNorm folded into its convolution (``seg-predict fold_bn=true``) against the network
as written: the fp32 channels-last forward, alternated in one process.

    .venv/bin/python experiments/bench_fold.py                  # 2048 x 2048, 4 models
    .venv/bin/python experiments/bench_fold.py --size 1024 --models unet_resnet34

Setup: the four ``bench_encoders.py`` networks (smp, 4 bands, 5 classes, random weights,
BatchNorm running statistics as after training: one train-mode pass over four 256 x 256
random crops), eval, channels-last, ``torch.inference_mode``. The folded copy is made by
:func:`seg_at_scale.models.fold.fold_batchnorm` as ``seg-predict`` makes it. One warm-up
forward each, then ``--repeats`` rounds, each timing both networks in alternating order;
the figure is the ratio of the medians (> 1: folding is faster). Also: the pairs folded,
the largest logit difference relative to the largest logit, and the labels that differ
(float ties). The load average is recorded per model (2 shared cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from common import add_harness_args, save

from seg_at_scale.models.fold import fold_batchnorm
from seg_at_scale.models.smp import SMPModel

MODELS = {"unet_resnet34": ("Unet", "resnet34"), "fpn_resnet50": ("FPN", "resnet50"),
          "deeplabv3plus_resnet50": ("DeepLabV3Plus", "resnet50"),
          "unet_convnext_tiny": ("Unet", "tu-convnext_tiny")}


def bench(name: str, size: int, repeats: int) -> dict[str, Any]:
    arch, enc = MODELS[name]
    torch.manual_seed(0)
    net = SMPModel(arch, enc, in_channels=4, num_classes=5).train()
    with torch.no_grad():
        net(torch.randn(4, 4, 256, 256))
    net.eval()
    cl = torch.channels_last
    folded, pairs = fold_batchnorm(net, torch.zeros(1, 4, 64, 64))
    bns = sum(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules())
    net, folded = net.to(memory_format=cl), folded.to(memory_format=cl)
    x = torch.randn(1, 4, size, size).contiguous(memory_format=cl)
    times: dict[str, list[float]] = {"as_written": [], "folded": []}
    with torch.inference_mode():
        a, b = net(x), folded(x)
        for r in range(repeats):
            order = [("as_written", net), ("folded", folded)]
            for key, m in order if r % 2 else order[::-1]:
                t0 = time.perf_counter()
                m(x)
                times[key].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"batchnorms": bns, "pairs_folded": pairs,
            "seconds": {k: [round(t, 3) for t in v] for k, v in times.items()},
            "speedup_median": round(med["as_written"] / med["folded"], 3),
            "max_logit_diff_rel": float((a - b).abs().max() / a.abs().max()),
            "labels_off_pct": round(100 * float((a.argmax(1) != b.argmax(1)).float().mean()), 5),
            "loadavg": os.getloadavg()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--models", nargs="*", default=list(MODELS))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--name", default="bench_fold", help="the result's benchmark name")
    add_harness_args(p, "256 x 256, Unet-ResNet34, 2 rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.repeats, args.models = 256, 2, ["unet_resnet34"]
    torch.set_num_threads(args.threads)
    out: dict[str, Any] = {}
    for name in args.models:
        out[name] = bench(name, args.size, args.repeats)
        print(name, {k: out[name][k] for k in ("pairs_folded", "speedup_median",
                                               "labels_off_pct")}, flush=True)
    save(args.name, {"what": "fp32 channels-last forward, BatchNorm folded vs as written",
                     "config": vars(args), "models": out}, args.out)


if __name__ == "__main__":
    main()
