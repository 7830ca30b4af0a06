"""``bench_gpu.py``'s ``encoders`` section: pretrained-encoder networks (smp) on the device.

Unet-ResNet34 and DeepLabV3+-ResNet50 (4 bands, 5 classes, random weights, BatchNorm
statistics calibrated on four crops of the image as ``bench_encoders.py`` does), on the
synthetic 4-band scene of ``enc_side``^2 resident on the device, normalised as
``(x / 255 - 0.5) / 0.25``. Runs, each timed as the best of ``enc_repeats`` after a warm-up
call (whose labels count), with the device's peak memory above the image and weights:

* ``untiled_fp32`` (TF32 off, contiguous: the reference labels) and ``untiled_fp32_cl``;
* ``ours_fp32_cl``: ``predict_tiled_exact`` (DeepLab's image pooling by its statistic pass)
  at ``enc_tile``, channels_last, logits on the device (where the image is);
  ``ours_bf16``: the same under bf16 autocast (the fast path);
* ``ours_auto_fp32`` / ``ours_auto_bf16``: ``infer(tile_size="auto")``, NCHW: what a user
  gets by default (untiled where the scene fits the device; ``auto_tile`` says the side);
* ``monai_<window>_<overlap>``: MONAI's Gaussian sliding window, fp32, ``sw_batch_size=4``,
  the whole image and its output on the device.

Each run gives Mpix/s, seconds, peak MiB and the % of labels off the untiled fp32 result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from bench_encoders import NORM, calibrated
from gpu_common import Peak, Sizes, attempt, precision, timed

from seg_at_scale.data.synthetic import SceneGenerator
from seg_at_scale.tiling import Window, infer, make_grid, predict_full
from seg_at_scale.tiling.auto_tile import auto_side
from seg_at_scale.tiling.statistic_passes import predict_tiled_exact
from seg_at_scale.tiling.tile_sides import covering_side

MODELS = ("unet_resnet34", "deeplabv3plus_resnet50")  # bench_encoders.MODELS' names
MONAI = ((512, 0.25), (1024, 0.25))


def encoders(dev: torch.device, sz: Sizes) -> dict[str, Any]:
    side = sz.enc_side
    raw = SceneGenerator(seed=0, height=side, width=side, bands=4).render(
        Window(0, 0, side, side))[0]
    x = torch.from_numpy(NORM(raw))[None].to(dev)
    out: dict[str, Any] = {"side": side, "tile": sz.enc_tile, "repeats": sz.enc_repeats,
                           "input": "synthetic 4-band scene, (x / 255 - 0.5) / 0.25",
                           "models": {}}
    for name in MODELS:
        out["models"][name] = attempt(lambda name=name: _model(name, x, dev, sz))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        print(f"   {name}: " + ", ".join(
            f"{k} {v.get('mpix_per_s')} Mpix/s ({v.get('labels_off_pct')} % off)"
            for k, v in out["models"][name].items() if isinstance(v, dict)
            and "mpix_per_s" in v), flush=True)
    return out


def _model(name: str, x: torch.Tensor, dev: torch.device, sz: Sizes) -> dict[str, Any]:
    net = calibrated(name, x)
    fp = net.footprint()
    side, tile = x.shape[-1], sz.enc_tile
    row: dict[str, Any] = {"halo": fp.halo, "align": fp.align,
                           "E": round(make_grid(side, side, fp, tile_size=tile).efficiency, 4)}
    ref: dict[str, torch.Tensor] = {}

    def run(name: str, fn: Callable[[], torch.Tensor], prec: str = "fp32") -> None:
        def measure() -> dict[str, Any]:
            with torch.inference_mode(), precision(prec, dev):
                # the warm-up call (kernel plans); the labels channels-last, so that the argmax
                # runs along a pixel's classes (along NCHW's planes the host took ~10 s for
                # the 8192^2 x 5 logits the exact path gives back)
                labels = fn().contiguous(memory_format=torch.channels_last).argmax(1).cpu()
                with Peak(dev) as peak:
                    times = timed(fn, dev, sz.enc_repeats, warmup=0)
            best = min(times)
            if not ref:
                ref["labels"] = labels
            off = float((labels != ref["labels"]).float().mean()) * 100
            return {"s": round(best, 4), "mpix_per_s": round(side * side / 1e6 / best, 3),
                    "peak_mib": peak.mib, "labels_off_pct": round(off, 4)}

        row[name] = attempt(measure)

    run("untiled_fp32", lambda: predict_full(net, x))
    cl = net.to(memory_format=torch.channels_last)
    xc = x.contiguous(memory_format=torch.channels_last)
    run("untiled_fp32_cl", lambda: predict_full(cl, xc))
    run("ours_fp32_cl", lambda: predict_tiled_exact(cl, x, tile_size=tile, channels_last=True))
    run("ours_bf16", lambda: predict_tiled_exact(cl, x, tile_size=tile, channels_last=True,
                                                 autocast=torch.bfloat16))
    # what a user gets by default: tile_size=auto (untiled where the scene fits), NCHW
    net = net.to(memory_format=torch.contiguous_format)
    row["auto_tile"] = attempt(lambda: {  # the side tile_size=auto takes; the covering one
        "fp32": auto_side(net, fp, side, side, x.shape[1]),
        "bf16": auto_side(net, fp, side, side, x.shape[1], autocast=torch.bfloat16),
        "whole_image": covering_side(fp, side, side)})
    run("ours_auto_fp32", lambda: infer(net, x, tile_size="auto"))
    run("ours_auto_bf16", lambda: infer(net, x, tile_size="auto", autocast=torch.bfloat16))
    try:
        from monai.inferers import sliding_window_inference
    except ImportError as e:
        row["monai"] = {"error": f"ImportError: {e}"}
        return row
    for window, overlap in MONAI:
        run(f"monai_{window}_{overlap}", lambda w=window, o=overlap: sliding_window_inference(
            x, (w, w), 4, net, overlap=o, mode="gaussian", padding_mode="constant", cval=0.0))
    for key in [k for k in row if k.startswith("monai_")]:
        theirs = row[key].get("mpix_per_s")
        for ours in ("ours_fp32_cl", "ours_auto_fp32", "ours_auto_bf16"):
            mine = row.get(ours, {}).get("mpix_per_s")
            if mine and theirs:
                row[key][f"{ours}_vs_this"] = round(mine / theirs, 3)
    return row
