"""U-Net forward FLOP/s on this CPU as a fraction of its measured matrix-multiply peak.

    .venv/bin/python experiments/bench_flops.py            # 4096^2 matmuls, U-Net on 512^2, ~3 min
    .venv/bin/python experiments/bench_flops.py --quick    # small smoke run

Peak: best-of-N ``a @ b`` on 4096 x 4096 matrices in fp32 and bf16 (AMX makes bf16 ~6x
faster on this CPU). U-Net FLOPs are counted with ``torch.utils.flop_counter`` (2 x MACs
of every convolution and transposed convolution) and checked against a count from the
layer shapes. Each precision / layout runs ``--warmup`` times, then ``--repeats`` rounds
round-robin (so load from other jobs on the shared cores hits all alike); figures come
from the best round, medians are saved too. Also saved: how far bf16 autocast labels are
from fp32 labels (fraction of identical argmax pixels on the synthetic scene), the
accuracy cost of the fast path. The model is untrained (``random_feature_init``: labels
vary over the image), its logits are closer to ties than a trained model's, so that
agreement is a pessimistic figure.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from common import add_harness_args, random_feature_init, save
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from seg_at_scale.data.synthetic import SceneGenerator
from seg_at_scale.models import UNet
from seg_at_scale.tiling import Window

MODES = {  # name -> (autocast dtype or None, channels_last)
    "fp32": (None, False),
    "fp32_channels_last": (None, True),
    "bf16_autocast": (torch.bfloat16, False),
    "bf16_autocast_channels_last": (torch.bfloat16, True),
}


def best_time(call: Callable[[], Any], warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def matmul_peak(n: int, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    """Best-of-``repeats`` FLOP/s of an ``n x n`` matrix product in ``dtype``."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    times = best_time(lambda: a @ b, 2, repeats)
    flops = 2 * n**3
    return {"n": n, "dtype": str(dtype), "times_s": times, "tflop_per_s": flops / min(times) / 1e12}


def shape_flops(net: nn.Module, x: torch.Tensor) -> int:
    """2 x MACs of every (transposed) convolution, from the layer shapes seen in a forward."""
    total = 0

    def hook(m: nn.Module, inp: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        nonlocal total
        assert isinstance(m, (nn.Conv2d, nn.ConvTranspose2d))
        k = m.kernel_size[0] * m.kernel_size[1] * m.in_channels * m.out_channels // m.groups
        pixels = (inp[0] if isinstance(m, nn.ConvTranspose2d) else out)[0, 0].numel()
        total += 2 * k * pixels * x.shape[0]

    handles = [m.register_forward_hook(hook) for m in net.modules()
               if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d))]
    with torch.no_grad():
        net(x)
    for h in handles:
        h.remove()
    return total


def counted_flops(net: nn.Module, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        net(x)
    return int(counter.get_total_flops())


def prepared(net: nn.Module, x: torch.Tensor, mode: str
             ) -> tuple[Callable[[], torch.Tensor], nn.Module, torch.Tensor]:
    """A no-grad forward call for ``mode`` (own model copy: ``.to(channels_last)`` is in place)."""
    dtype, cl = MODES[mode]
    m = copy.deepcopy(net)
    if cl:
        m = m.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)

    def call() -> torch.Tensor:
        ctx = (torch.autocast("cpu", dtype=dtype) if dtype is not None
               else contextlib.nullcontext())
        with torch.inference_mode(), ctx:
            return m(x)

    return call, m, x


def synthetic_batch(batch: int, size: int, bands: int) -> torch.Tensor:
    """``batch`` different ``size x size`` windows of the synthetic scene, ``/255``."""
    gen = SceneGenerator(seed=0, height=size * batch, width=size, bands=bands)
    crops = [gen.render(Window(k * size, 0, size, size))[0] for k in range(batch)]
    return torch.stack([torch.from_numpy(c) for c in crops]).float().div_(255)


def bench_batch(net: UNet, batch: int, args: argparse.Namespace, peaks: dict[str, float]
                ) -> dict[str, Any]:
    x = synthetic_batch(batch, args.size, args.bands)
    flops = counted_flops(net, x)
    calls = {mode: prepared(net, x, mode)[0] for mode in MODES}
    outs = {mode: call() for mode, call in calls.items()}  # first warm-up; kept for accuracy
    for call in calls.values():
        for _ in range(args.warmup - 1):
            call()
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[mode].append(time.perf_counter() - t0)
    ref = outs["fp32"].float()
    ref_labels = ref.argmax(1)
    rows: dict[str, Any] = {}
    mpix = batch * args.size**2 / 1e6
    for mode, t in times.items():
        dtype = "bf16" if MODES[mode][0] is not None else "fp32"
        y = outs[mode].float()
        rows[mode] = {
            "times_s": t, "mpix_per_s": mpix / min(t),
            "mpix_per_s_median": mpix / statistics.median(t),
            "tflop_per_s": flops / min(t) / 1e12,
            "fraction_of_peak": flops / min(t) / 1e12 / peaks[dtype], "peak_used": dtype,
            "fraction_of_bf16_peak": flops / min(t) / 1e12 / peaks["bf16"],
            "labels_identical_to_fp32": (y.argmax(1) == ref_labels).double().mean().item(),
            "max_abs_logit_diff_to_fp32": (y - ref).abs().max().item(),
            "logit_std_fp32": ref.std().item(),
            "speedup_vs_fp32": min(times["fp32"]) / min(t),
        }
    return {"batch": batch, "gflop_per_forward": flops / 1e9,
            "gflop_per_mpix": flops / 1e9 / mpix, "modes": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--matmul", type=int, default=4096, help="matrix side for the peak")
    p.add_argument("--size", type=int, default=512, help="U-Net input side")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--levels", type=int, default=4)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--bands", type=int, default=4)
    p.add_argument("--classes", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--name", default="bench_flops", help="the result's benchmark name")
    add_harness_args(p, "1024^2 matmul, 128^2 U-Net input, batch 1, 2 rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.matmul, args.size, args.batches, args.repeats, args.warmup = 1024, 128, [1], 2, 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    peaks = {"fp32": matmul_peak(args.matmul, torch.float32, args.repeats),
             "bf16": matmul_peak(args.matmul, torch.bfloat16, args.repeats)}
    peak_tflops = {k: v["tflop_per_s"] for k, v in peaks.items()}
    print(f"matmul peak TFLOP/s: {peak_tflops}", flush=True)
    torch.manual_seed(0)
    net = random_feature_init(UNet(args.bands, args.classes, levels=args.levels,
                                   convs_per_level=2, base_width=args.width,
                                   padding="same")).eval()
    x1 = synthetic_batch(1, args.size, args.bands)
    check = {"flop_counter": counted_flops(net, x1), "from_layer_shapes": shape_flops(net, x1)}
    results = []
    for batch in args.batches:
        results.append(bench_batch(net, batch, args, peak_tflops))
        print(f"batch {batch}: " + ", ".join(
            f"{m} {r['mpix_per_s']:.2f} Mpix/s ({100 * r['fraction_of_peak']:.1f} % of peak)"
            for m, r in results[-1]["modes"].items()), flush=True)
    b1 = results[0]["modes"]
    save(args.name, {
        "what": "U-Net forward FLOP/s as a fraction of the measured matmul peak, fp32 and bf16",
        "method": f"{args.matmul}^2 matmul best of {args.repeats}; same-padding U-Net "
                  f"(levels {args.levels}, width {args.width}, {args.bands} bands, "
                  f"{args.classes} classes, untrained with random_feature_init, eval) on "
                  f"{args.size}^2 synthetic-scene windows; {args.warmup} warm-ups, "
                  f"{args.repeats} round-robin rounds, best round (median too); "
                  "FLOPs = 2 x MACs of convs and transposed convs "
                  "(torch FlopCounterMode, checked against layer shapes); figures are from one "
                  "run on 2 shared cores, compare ratios within this file",
        "threads": args.threads, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "matmul_peak": peaks, "flop_count_check_batch1": check, "unet": results,
        "summary": {
            "peak_tflop_per_s": peak_tflops,
            "bf16_over_fp32_matmul": peak_tflops["bf16"] / peak_tflops["fp32"],
            "batch1_mpix_per_s": {m: r["mpix_per_s"] for m, r in b1.items()},
            "batch1_fraction_of_peak": {m: r["fraction_of_peak"] for m, r in b1.items()},
            "bf16_cl_labels_identical_to_fp32": min(
                r["modes"]["bf16_autocast_channels_last"]["labels_identical_to_fp32"]
                for r in results),
        },
    }, args.out)


if __name__ == "__main__":
    main()
