"""Our streaming prediction against MONAI's ``sliding_window_inference``: speed, memory, exactness.

    .venv/bin/python experiments/bench_monai.py            # 16384 x 16384, tiny U-Net, ~15 min
    .venv/bin/python experiments/bench_monai.py --quick    # 2048 x 2048 smoke run

Targets (issue): on a 16384 x 16384 4-band image, our throughput >= 1.0x MONAI's and our
peak memory <= 1/4 of theirs; report how far MONAI's output is from the exact one.

Setup: a tiny same-padding U-Net (untrained, ``random_feature_init`` so that its labels
vary over the image; eval; one state dict for every run). The
image is the synthetic scene, written once as an uncompressed tiled uint8 TIFF (not
timed). *Ours*: ``predict_raster`` file to file (read windows, x/255, model, argmax,
zlib-compressed uint8 TIFF out) with ``tile_size=T``; its time includes reading and
writing. *MONAI*: the TIFF loaded into memory as a float tensor (x/255, the same float32
arithmetic as ours), then ``sliding_window_inference`` with ``roi_size = T`` (= core + 2
context, the window our tiles use) and ``overlap = 2 context / T`` so the window stride
equals a core, ``sw_batch_size=1``, padding with zeros (as our same-padding halo does);
its throughput counts the ``sliding_window_inference`` call only (load and argmax are
reported apart), which favours MONAI. Each run is a fresh process, one at a time (never
concurrently), after one warm-up forward on a T x T window; peak memory is the process's
own ``ru_maxrss``. Exact output: our fp32 labels; checked on a central crop against the
model run on that crop plus its context (equal to the whole-image output there, docs/design.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import add_harness_args, peak_rss_self_mib, random_feature_init, run_isolated, save

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.data.synthetic import SceneGenerator
from seg_at_scale.io import RasterReader, write_raster_bands
from seg_at_scale.models import UNet
from seg_at_scale.prediction import PredictOptions, predict_raster
from seg_at_scale.tiling import Window, make_grid

SCALE = 1 / 255


def build_model(cfg: dict[str, Any]) -> UNet:
    net = random_feature_init(UNet(cfg["bands"], cfg["classes"], levels=cfg["levels"],
                                   convs_per_level=2, base_width=cfg["width"], padding="same"))
    if "weights" in cfg:
        net.load_state_dict(torch.load(cfg["weights"], weights_only=True))
    return net.eval()


def _child_setup(cfg: dict[str, Any]) -> UNet:
    torch.set_num_threads(cfg["threads"])
    net = build_model(cfg)
    with torch.inference_mode():  # one warm-up forward on a window, the same for both
        net(torch.zeros(1, cfg["bands"], cfg["tile"], cfg["tile"]))
    return net


def run_ours(cfg: dict[str, Any], fast: bool) -> dict[str, Any]:
    """Child process: ``predict_raster`` file to file; fp32, or bf16 autocast + NHWC."""
    net = _child_setup(cfg)
    if fast:
        net = net.to(memory_format=torch.channels_last)
    out = Path(cfg["workdir"]) / f"ours_{'bf16_cl' if fast else 'fp32'}.tif"
    stats = predict_raster(net, cfg["image"], out,
                           PredictOptions(tile_size=cfg["tile"], overwrite=True, fast=fast),
                           normalizer=Normalizer(scale=SCALE))
    return {"labels": str(out), "tiles": stats.tiles, "efficiency": stats.efficiency,
            "total_s": stats.total_s, "read_s": stats.read_s, "read_wait_s": stats.read_wait_s,
            "model_s": stats.model_s, "write_s": stats.write_s, "mpix_per_s": stats.mpix_per_s,
            "peak_rss_self_mib": peak_rss_self_mib()}


def run_monai(cfg: dict[str, Any], mode: str) -> dict[str, Any]:
    """Child process: whole image in memory, ``sliding_window_inference``, argmax to uint8."""
    from monai.inferers import sliding_window_inference

    net = _child_setup(cfg)
    t0 = time.perf_counter()
    with RasterReader(cfg["image"]) as reader:
        raw = reader.read(Window(0, 0, reader.height, reader.width))
    x = torch.from_numpy(raw).unsqueeze(0).float().mul_(np.float32(SCALE).item())
    del raw
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.inference_mode():
        y = sliding_window_inference(x, (cfg["tile"], cfg["tile"]), 1, net,
                                     overlap=cfg["overlap"], mode=mode, padding_mode="constant",
                                     cval=0.0)
    infer_s = time.perf_counter() - t0
    del x
    t0 = time.perf_counter()
    h = y.shape[-2]
    labels = np.empty(y.shape[-2:], np.uint8)
    for r in range(0, h, 1024):  # argmax in row bands: no full-size int64 temporary
        labels[r : r + 1024] = y[0, :, r : r + 1024].argmax(0).to(torch.uint8).numpy()
    argmax_s = time.perf_counter() - t0
    r0, c0, n = cfg["crop"]
    crop = y[0, :, r0 : r0 + n, c0 : c0 + n].numpy().copy()
    del y
    path = Path(cfg["workdir"]) / f"monai_{mode}"
    np.save(f"{path}_labels.npy", labels)
    np.save(f"{path}_crop_logits.npy", crop)
    mpix = labels.size / 1e6
    return {"labels": f"{path}_labels.npy", "crop_logits": f"{path}_crop_logits.npy",
            "load_s": load_s, "infer_s": infer_s, "argmax_s": argmax_s,
            "mpix_per_s": mpix / infer_s, "mpix_per_s_end_to_end": mpix / (load_s + infer_s
                                                                          + argmax_s),
            "peak_rss_self_mib": peak_rss_self_mib()}


def write_input(path: Path, size: int, bands: int) -> None:
    """The synthetic scene as an uncompressed tiled uint8 TIFF, streamed in row bands."""
    gen = SceneGenerator(seed=0, height=size, width=size, bands=bands)
    rows = [Window(r, 0, min(1024, size - r), size) for r in range(0, size, 1024)]
    write_raster_bands(path, gen.shape, np.uint8, (gen.render(w)[0] for w in rows),
                       tile=(256, 256), compression=None, overwrite=True)


def exact_crop_logits(cfg: dict[str, Any], net: UNet) -> np.ndarray:
    """Whole-image fp32 logits of the crop: the model on the crop plus aligned context."""
    r0, c0, n = cfg["crop"]
    ctx = net.footprint().context
    with RasterReader(cfg["image"]) as reader:
        raw = reader.read(Window(r0 - ctx, c0 - ctx, n + 2 * ctx, n + 2 * ctx))
    x = torch.from_numpy(Normalizer(scale=SCALE)(raw)).unsqueeze(0)
    with torch.inference_mode():
        y = net(x)
    return y[0, :, ctx : ctx + n, ctx : ctx + n].numpy()


def read_labels(path: str) -> np.ndarray:
    if path.endswith(".npy"):
        return np.load(path, mmap_mode="r")
    with RasterReader(path) as reader:
        return reader.read(Window(0, 0, reader.height, reader.width))[0]


def differing_fraction(a: np.ndarray, b: np.ndarray) -> float:
    n = sum(int(np.count_nonzero(a[r : r + 1024] != b[r : r + 1024]))
            for r in range(0, a.shape[0], 1024))
    return n / a.size


def compare(cfg: dict[str, Any], runs: dict[str, dict[str, Any]], net: UNet) -> dict[str, Any]:
    """Distances of every run's labels (and MONAI's crop logits) from the exact output."""
    exact = read_labels(runs["ours_fp32"]["labels"])
    crop_exact = exact_crop_logits(cfg, net)
    r0, c0, n = cfg["crop"]
    out: dict[str, Any] = {"ours_fp32_crop_labels_equal_exact": bool(np.array_equal(
        exact[r0 : r0 + n, c0 : c0 + n], crop_exact.argmax(0)))}
    for name, run in runs.items():
        if name == "ours_fp32" or run.get("status") == "error":
            continue
        labels = read_labels(run["labels"])
        row = {"labels_differing_fraction": differing_fraction(labels, exact)}
        if "crop_logits" in run:
            diff = np.abs(np.load(run["crop_logits"]) - crop_exact)
            row.update(crop_max_abs_logit_diff=float(diff.max()),
                       crop_mean_abs_logit_diff=float(diff.mean()),
                       crop_fraction_logits_off_by_gt_1e_4=float((diff.max(0) > 1e-4).mean()))
        out[name] = row
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=16384, help="image side in pixels")
    p.add_argument("--tile", type=int, default=1024, help="tile / MONAI window side")
    p.add_argument("--levels", type=int, default=3)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--bands", type=int, default=4)
    p.add_argument("--classes", type=int, default=5)
    p.add_argument("--modes", nargs="*", default=["constant"],
                   help="MONAI blend modes to run (also: gaussian)")
    p.add_argument("--crop", type=int, default=2048, help="side of the logit-comparison crop")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder")
    p.add_argument("--keep", action="store_true", help="keep the images in --workdir")
    p.add_argument("--name", default="bench_monai", help="the result's benchmark name")
    add_harness_args(p, "1024^2 image, 512 tiles, 256^2 crop")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.tile, args.crop, args.modes = 1024, 512, 256, ["constant"]
    return args


def setup(args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Any], UNet]:
    cfg = {k: getattr(args, k) for k in ("size", "tile", "levels", "width", "bands", "classes",
                                         "threads")}
    torch.manual_seed(0)
    net = build_model(cfg)
    fp = net.footprint()
    cfg["weights"] = str(workdir / "model.pt")
    torch.save(net.state_dict(), cfg["weights"])
    cfg["image"], cfg["workdir"] = str(workdir / "image.tif"), str(workdir)
    core = args.tile - 2 * fp.context
    cfg["overlap"] = 2 * fp.context / args.tile
    if int(args.tile * (1 - cfg["overlap"])) != core:  # MONAI's stride: int(roi * (1 - o))
        cfg["overlap"] -= 1e-9
    mid = (args.size - args.crop) // 2 // fp.align * fp.align
    cfg["crop"] = (mid, mid, args.crop)
    cfg["footprint"] = {"halo": fp.halo, "context": fp.context, "align": fp.align}
    cfg["monai_stride"], cfg["our_grid"] = core, list(make_grid(
        args.size, args.size, fp, tile_size=args.tile).shape)
    windows = (-(-(args.size - args.tile) // core) + 1) ** 2
    cfg["monai_windows"], cfg["monai_efficiency"] = windows, windows * args.tile**2 / args.size**2
    return cfg, net


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_monai_"))
    workdir.mkdir(parents=True, exist_ok=True)
    cfg, net = setup(args, workdir)
    t0 = time.perf_counter()
    write_input(Path(cfg["image"]), args.size, args.bands)
    print(f"input written in {time.perf_counter() - t0:.1f} s; config {cfg}", flush=True)
    loads = [os.getloadavg()]
    runs: dict[str, dict[str, Any]] = {}
    jobs = [("ours_fp32", run_ours, False)] + [(f"monai_{m}", run_monai, m) for m in args.modes]
    jobs.append(("ours_bf16_channels_last", run_ours, True))
    for name, fn, arg in jobs:  # sequentially, one process at a time
        res = run_isolated(fn, cfg, arg)
        runs[name] = {"status": res["status"], "peak_rss_sampled_mib": res["peak_rss_mib"],
                      "process_wall_s": res["wall_s"],
                      **(res["result"] if res["status"] == "ok" else {"error": res["result"]})}
        loads.append(os.getloadavg())
        print(f"{name}: {runs[name]}", flush=True)
    distance = compare(cfg, runs, net)
    summary: dict[str, Any] = {}
    ours = runs["ours_fp32"]
    for m in args.modes:
        theirs = runs[f"monai_{m}"]
        if theirs["status"] != "ok" or ours["status"] != "ok":
            continue
        thr = ours["mpix_per_s"] / theirs["mpix_per_s"]
        mem = ours["peak_rss_self_mib"] / theirs["peak_rss_self_mib"]
        summary[f"vs_monai_{m}"] = {
            "throughput_ratio_ours_over_monai": thr, "pass_throughput_ge_1": thr >= 1.0,
            "peak_memory_ratio_ours_over_monai": mem, "pass_memory_le_0.25": mem <= 0.25,
            "monai_labels_differing_fraction": distance[f"monai_{m}"]["labels_differing_fraction"],
            "monai_crop_max_abs_logit_diff": distance[f"monai_{m}"]["crop_max_abs_logit_diff"]}
    if runs["ours_bf16_channels_last"]["status"] == "ok":
        summary["ours_bf16_cl_speedup_over_ours_fp32"] = (
            runs["ours_bf16_channels_last"]["mpix_per_s"] / ours["mpix_per_s"])
    cfg = {k: v for k, v in cfg.items() if k not in ("weights", "image", "workdir")}
    save(args.name, {
        "what": "predict_raster (streaming, file to file) vs MONAI sliding_window_inference "
                "(in memory), same model, same image, same run, run one after another",
        "targets": "throughput ours/MONAI >= 1.0; peak RSS ours/MONAI <= 0.25; report MONAI's "
                   "distance from the exact output",
        "method": __doc__.split("Setup:")[1].strip(),
        "noise": "2 shared cores: other jobs may run beside this one; loadavg per run below",
        "config": cfg, "loadavg_before_and_after_each_run": loads, "runs": runs,
        "distance_from_exact": distance, "summary": summary,
    }, args.out)
    if not args.keep and args.workdir is None:
        shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
