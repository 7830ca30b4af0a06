"""Sample parallelism on this CPU: 2 processes (1 thread each) vs 1, exactness in the same run.

    .venv/bin/python experiments/bench_sample_parallel.py          # ~3 min on 2 cores

One exact whole-image training step (forward + backward of the whole image's loss, tile by
tile, ``tiled_backward``) on a synthetic 4-band scene with its mask; the q x q tiles are
shared round-robin by the ranks, whose gradients are summed by one gloo all-reduce
(``all_reduce_gradients``), exactly as ``trainer=ddp`` does per image. Baseline: the same
step in 1 process with 1 thread. Figures: step time and throughput ratio (ideal 2.0 on 2
cores), and the largest relative gradient difference between the 2-process and 1-process
results (float32 summation order only) and vs the untiled float64 gradient.

Model: same-padding U-Net, 4 levels, base width 16 (``small``), fp32, seeded.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import add_harness_args, save

from seg_at_scale.data.synthetic import SceneGenerator
from seg_at_scale.models import UNet
from seg_at_scale.parallel.launch import all_reduce_gradients, spawn
from seg_at_scale.tasks.losses import CrossEntropy
from seg_at_scale.tiling import Window, tiled_backward
from seg_at_scale.tiling.predict import extend


def case(side: int) -> tuple[UNet, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = UNet(4, 5, levels=4, convs_per_level=2, base_width=16, padding="same")
    img, mask = SceneGenerator(seed=3, height=side, width=side).render(Window(0, 0, side, side))
    image = torch.from_numpy(img.astype("float32"))[None] / 255.0
    target = torch.from_numpy(mask.astype("int64"))[None]
    return net, image, target


def worker(rank: int, world: int, side: int, q: int, repeats: int, out: str) -> None:
    net, image, target = case(side)
    times = []
    for r in range(repeats + 1):
        net.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        tiled_backward(net, image, target, CrossEntropy(5), q=q, shard=(rank, world))
        all_reduce_gradients(net.parameters(), "sum")
        if r:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        torch.save({"grads": [p.grad for p in net.parameters()], "step_s": times}, out)


def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.double() - y.double()).abs().max() / y.double().abs().max())
               for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", type=int, default=1536)
    ap.add_argument("--q", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    add_harness_args(ap, "256^2 scene, q 2, one timed step")
    args = ap.parse_args(argv)
    if args.quick:
        args.side, args.q, args.repeats = 256, 2, 1
    res: dict[str, Any] = {"side": args.side, "q": args.q, "tiles": args.q**2}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for world in (1, 2):
            out = str(Path(tmp) / f"w{world}.pt")
            spawn(worker, world, args.side, args.q, args.repeats, out, threads=1)
            runs[world] = torch.load(out, weights_only=True)
            t = statistics.median(runs[world]["step_s"])
            res[f"processes_{world}"] = {"step_s": t, "mpix_per_s": args.side**2 / t / 1e6}
            print(f"{world} process(es) x 1 thread: {t:.2f} s per exact step", flush=True)
    res["speedup"] = res["processes_1"]["step_s"] / res["processes_2"]["step_s"]
    res["grad_rel_diff_2proc_vs_1proc"] = rel(runs[2]["grads"], runs[1]["grads"])
    net, image, target = case(args.side)
    net = net.double()
    fp = net.footprint()
    s, w = CrossEntropy(5)(net(extend(image.double(), fp))[..., : args.side, : args.side], target)
    (s / w).backward()
    ref = [p.grad for p in net.parameters()]
    res["grad_rel_diff_2proc_vs_untiled_float64"] = rel(runs[2]["grads"], ref)
    res["grad_rel_diff_1proc_vs_untiled_float64"] = rel(runs[1]["grads"], ref)
    save("bench_sample_parallel", res, args.out)


if __name__ == "__main__":
    main()
