"""Pretrained-encoder networks (smp) tiled exactly, against MONAI's sliding window.

    .venv/bin/python experiments/bench_encoders.py                    # 4096 x 4096, 4 models
    .venv/bin/python experiments/bench_encoders.py --size 2048 --name bench_encoders_2048

Targets (issue 22), per model at 4096^2: our throughput >= 1.2x MONAI's, our peak memory
<= 1/4 of MONAI's, 0 labels off the untiled result; tiled >= 0.9 / E of the untiled forward.

Setup: Unet-ResNet34, FPN-ResNet50, DeepLabV3+-ResNet50 (output stride 16) and
Unet-ConvNeXt-T (smp, ``seg_at_scale.models.SMPModel``), 4 input bands, 5 classes; random
weights, BatchNorm running statistics set as after training (one train-mode pass over a
batch of four 512 x 512 crops of the image), eval; one state dict per model for every run.
The image is the synthetic 4-band scene, an uncompressed tiled uint8 TIFF (not timed),
normalised as ``(x / 255 - 0.5) / 0.25``. Runs, each a fresh process, one after another:

* *untiled*: the whole (zero-extended) image in one forward, fp32 (contiguous and NHWC):
  the reference labels;
* *ours*: ``predict_raster`` file to file (read, normalise, model, argmax, write a COG),
  tile per model (below); fp32 contiguous (today's ``fast=false``), fp32 channels_last, the
  bf16 fast path (autocast + channels_last). Whole-image statistics: DeepLabV3+'s image
  pooling by the raster path's own first pass, FPN's GroupNorms by
  the raster path's statistic passes over windows read from the file (timed with the run);
* *ours staged*: ``predict_raster`` with ``staged=True`` (seg-predict ``staged=true``), file
  to file: the image read by window, maps and logits in files beside the output, tiles of
  ``--budget`` floats (``stage_memory_mb``); ``ours_staged_fp32_cl_folded`` is the staged run
  with ``fold_bn=true`` (BatchNorm folded into its convolutions);
* *staged* (``--budget``): the image loaded in memory, ``predict_staged``: each stage of
  the network (the encoder's stages, then decoder + head) tiled over the whole feature maps
  with its own halo, tiles of at most ``budget`` floats: input windows and what the
  stage's forward holds at once (deep
  stages: one tile); fp32 channels_last and bf16; the stage plan (probe) is timed apart;
  the maps between stages in memory, or with ``--store`` in files read by window;
* *MONAI*: the image loaded in memory, ``sliding_window_inference`` with Gaussian blending
  at window 512 / overlap 0.25, 1024 / 0.25 and 1024 / 0.5 (the issue's settings), fp32
  contiguous (as users run it), ``sw_batch_size=1``; throughput counts the call only.

Peak memory is each process's resident set sampled every 10 ms (``ru_maxrss`` is also
given, but Linux carries it over from the parent); the load average is recorded around every
run (2 shared cores). Efficiency E (input pixels computed / output pixels) is given for
tiles 1024 to 4096 at the image size; our tile is the smallest with E <= 2.5 unless
``--tile`` says. The fp32 contiguous run (today's ``fast=false``) is made for the first
model only (the channels_last gain).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import RESULTS, add_harness_args, peak_rss_self_mib, run_isolated, save

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.data.synthetic import SceneGenerator
from seg_at_scale.io import RasterReader, write_raster_bands
from seg_at_scale.models.smp import SMPModel
from seg_at_scale.tiling import Footprint, TilingError, Window, make_grid

NORM = Normalizer(1 / 255, (0.5,) * 4, (0.25,) * 4)
MODELS = {"unet_resnet34": ("Unet", "resnet34"), "fpn_resnet50": ("FPN", "resnet50"),
          "deeplabv3plus_resnet50": ("DeepLabV3Plus", "resnet50"),
          "unet_convnext_tiny": ("Unet", "tu-convnext_tiny")}
MONAI = [(512, 0.25), (1024, 0.25), (1024, 0.5)]


def build(cfg: dict[str, Any]) -> SMPModel:
    arch, enc = MODELS[cfg["model"]]
    net = SMPModel(arch, enc, in_channels=4, num_classes=5)
    net.load_state_dict(torch.load(cfg["weights"], weights_only=True))
    return net.eval()


def read_image(cfg: dict[str, Any]) -> torch.Tensor:
    with RasterReader(cfg["image"]) as reader:
        raw = reader.read(Window(0, 0, reader.height, reader.width))
    return torch.from_numpy(NORM(raw))[None]


def _setup(cfg: dict[str, Any], channels_last: bool) -> SMPModel:
    torch.set_num_threads(cfg["threads"])
    net = build(cfg)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    return net


def run_untiled(cfg: dict[str, Any], channels_last: bool) -> dict[str, Any]:
    """Child: the whole image, one forward (the reference)."""
    net = _setup(cfg, channels_last)
    x = read_image(cfg)
    a = net.downsampling_factor
    h, w = x.shape[-2:]
    x = torch.nn.functional.pad(x, (0, -w % a, 0, -h % a))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    t0 = time.perf_counter()
    with torch.inference_mode():
        y = net(x)[..., :h, :w]
    seconds = time.perf_counter() - t0
    labels = y[0].argmax(0).to(torch.uint8).numpy()
    path = Path(cfg["workdir"]) / f"{cfg['model']}_untiled_{'cl' if channels_last else 'fp32'}.npy"
    np.save(path, labels)
    return {"labels": str(path), "seconds": seconds, "mpix_per_s": h * w / 1e6 / seconds,
            "peak_rss_self_mib": peak_rss_self_mib()}


def run_ours(cfg: dict[str, Any], variant: str) -> dict[str, Any]:
    """Child: ``predict_raster`` file to file (its own statistic passes for DeepLab / FPN)."""
    from seg_at_scale.prediction import PredictOptions, predict_raster

    cl, fast = variant != "fp32", variant == "bf16_cl"
    staged = variant.startswith("staged")
    fold = variant.endswith("_folded")  # seg-predict's fold_bn (default false)
    net = _setup(cfg, cl)
    fp = Footprint(**cfg["footprint"])
    out = Path(cfg["workdir"]) / f"{cfg['model']}_ours_{variant}.tif"
    t0 = time.perf_counter()
    stats = predict_raster(net, cfg["image"], out,
                           PredictOptions(tile_size=cfg["tile"], fast=fast,
                                          layout="channels_last" if cl else "contiguous",
                                          staged=staged, stage_memory_mb=cfg["budget"] * 4 >> 20,
                                          fold_bn=fold,
                                          overwrite=True, progress=False),
                           fp=fp, normalizer=NORM)
    seconds = time.perf_counter() - t0
    with RasterReader(out) as r:
        labels = r.read(Window(0, 0, r.height, r.width))[0]
    path = Path(cfg["workdir"]) / f"{cfg['model']}_ours_{variant}.npy"
    np.save(path, labels)
    return {"labels": str(path), "seconds": seconds, "tiles": stats.tiles,
            "efficiency": stats.efficiency, "statistics_s": stats.statistics_s,
            "mpix_per_s": labels.size / 1e6 / seconds, "peak_rss_self_mib": peak_rss_self_mib()}


def run_staged(cfg: dict[str, Any], variant: str) -> dict[str, Any]:
    """Child: the image in memory, ``predict_staged`` (each stage tiled over whole maps)."""
    from seg_at_scale.models.smp_stage_split import smp_stages
    from seg_at_scale.tiling.staged import plan_stages, predict_staged

    net = _setup(cfg, True)
    x = read_image(cfg)
    stages = smp_stages(net)
    t0 = time.perf_counter()
    plan = plan_stages(stages, x.shape[1], net.downsampling_factor)
    plan_s = time.perf_counter() - t0
    eff: list[float] = []
    t0 = time.perf_counter()
    y = predict_staged(stages, x, align=net.downsampling_factor, budget=cfg["budget"],
                       plan=plan, channels_last=True, efficiency=eff, store=cfg.get("store"),
                       autocast=torch.bfloat16 if variant == "bf16_cl" else None)
    seconds = time.perf_counter() - t0
    labels = y[0].argmax(0).to(torch.uint8).numpy()
    path = Path(cfg["workdir"]) / f"{cfg['model']}_staged_{variant}.npy"
    np.save(path, labels)
    return {"labels": str(path), "seconds": seconds, "plan_s": round(plan_s, 1),
            "stage_halos": [f.halo for f in plan.footprints],
            "stage_efficiency": [round(e, 3) for e in eff], "budget_floats": cfg["budget"],
            "store": cfg.get("store") or "memory",
            "mpix_per_s": labels.size / 1e6 / seconds, "peak_rss_self_mib": peak_rss_self_mib()}


def run_monai(cfg: dict[str, Any], setting: tuple[int, float]) -> dict[str, Any]:
    """Child: the image in memory, MONAI's Gaussian sliding window."""
    from monai.inferers import sliding_window_inference

    window, overlap = setting
    net = _setup(cfg, False)
    x = read_image(cfg)
    t0 = time.perf_counter()
    with torch.inference_mode():
        y = sliding_window_inference(x, (window, window), 1, net, overlap=overlap,
                                     mode="gaussian", padding_mode="constant", cval=0.0)
    seconds = time.perf_counter() - t0
    labels = y[0].argmax(0).to(torch.uint8).numpy()
    path = Path(cfg["workdir"]) / f"{cfg['model']}_monai_{window}_{overlap}.npy"
    np.save(path, labels)
    return {"labels": str(path), "seconds": seconds, "mpix_per_s": labels.size / 1e6 / seconds,
            "peak_rss_self_mib": peak_rss_self_mib()}


def calibrated(name: str, x: torch.Tensor, spec: tuple[str, str] | None = None) -> SMPModel:
    """``MODELS[name]`` (or ``spec``: architecture, encoder) seeded on ``x``'s device,
    BatchNorm statistics from one train-mode pass over four crops of ``x`` (DeepLab's pooled
    BatchNorm needs a batch > 1), eval."""
    arch, enc = spec or MODELS[name]
    torch.manual_seed(0)
    net = SMPModel(arch, enc, in_channels=4, num_classes=5).to(x.device)
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None  # cumulative average over the calibration crops
    c = min(512, x.shape[-1] // 2)
    net.train()
    with torch.no_grad():
        net(torch.cat([x[..., r : r + c, s : s + c] for r in (0, c) for s in (0, c)]))
    return net.eval()


def prepare_model(name: str, cfg: dict[str, Any], workdir: str) -> dict[str, Any]:
    """Child: weights (BatchNorm calibrated on image crops), footprint, E, our tile."""
    torch.set_num_threads(cfg["threads"])
    net = calibrated(name, read_image({"image": cfg["image"]}))
    t0 = time.perf_counter()
    fp = net.footprint()
    probe_s = time.perf_counter() - t0
    weights = Path(workdir) / f"{name}.pt"
    torch.save(net.state_dict(), weights)
    eff: dict[str, Any] = {}
    for tile in (1024, 2048, 3072, 4096):
        try:
            eff[str(tile)] = round(make_grid(cfg["size"], cfg["size"], fp, tile_size=tile,
                                             uniform=True).efficiency, 4)
        except TilingError:
            eff[str(tile)] = f"impossible: tiles need >= {2 * fp.context + fp.align} pixels"
    tile = cfg["tile"] or _best_tile(eff)
    return {"model": name, "weights": str(weights), "probe_s": round(probe_s, 1), "tile": tile,
            "footprint": {"halo": fp.halo, "align": fp.align, "padding": fp.padding},
            "context": fp.context, "statistic_levels": net.statistic_levels(),
            "efficiency_at_size": eff, "parameters_m": round(
                sum(p.numel() for p in net.parameters()) / 1e6, 2)}


def _best_tile(eff: dict[str, Any]) -> int:
    """The smallest candidate tile with E <= 2.5, else the one with the smallest E."""
    ok = {int(t): e for t, e in eff.items() if isinstance(e, float)}
    good = [t for t, e in sorted(ok.items()) if e <= 2.5]
    return good[0] if good else min(ok, key=ok.get)  # type: ignore[arg-type]


def off(labels: str, reference: str) -> float:
    a, b = np.load(labels), np.load(reference)
    return round(100 * float((a != b).mean()), 4)


def bench_model(name: str, base: dict[str, Any], loads: list, contiguous: bool
                ) -> dict[str, Any]:
    prep = run_isolated(prepare_model, name, base, base["workdir"])
    if prep["status"] != "ok":
        raise RuntimeError(f"{name}: {prep['result']}")
    facts = prep["result"]
    cfg = {**base, **facts, "model": name}
    print(f"{name}: {facts}", flush=True)
    jobs: list[tuple[str, Any, Any]] = [("untiled_fp32", run_untiled, False),
                                        ("untiled_fp32_channels_last", run_untiled, True)]
    variants = ("fp32", "fp32_cl", "bf16_cl") if contiguous else ("fp32_cl", "bf16_cl")
    jobs += [(f"ours_{v}", run_ours, v) for v in (*variants, "staged_fp32_cl",
                                                  "staged_fp32_cl_folded")]
    jobs += [(f"staged_{v}", run_staged, v) for v in ("fp32_cl", "bf16_cl")]
    jobs += [(f"monai_{w}_{o}", run_monai, (w, o)) for w, o in MONAI]
    if base.get("runs"):
        jobs = [j for j in jobs if j[0] in base["runs"]]
    runs: dict[str, Any] = {}
    for key, fn, arg in jobs:
        res = run_isolated(fn, cfg, arg)
        runs[key] = {"status": res["status"], "peak_rss_sampled_mib": round(res["peak_rss_mib"]),
                     **(res["result"] if res["status"] == "ok" else {"error": res["result"]})}
        loads.append((f"{name}/{key}", os.getloadavg()))
        print(f"  {key}: {runs[key]}", flush=True)
    return {**facts, "runs": runs, "summary": summarise(runs, facts)}


def summarise(runs: dict[str, Any], facts: dict[str, Any]) -> dict[str, Any]:
    ok = {k: v for k, v in runs.items() if v["status"] == "ok"}
    ref = ok.get("untiled_fp32", {}).get("labels")
    out: dict[str, Any] = {}
    if ref:
        out["labels_off_pct_vs_untiled_fp32"] = {k: off(v["labels"], ref) for k, v in ok.items()
                                                 if k != "untiled_fp32"}
    exact = ok.get("ours_staged_fp32_cl", {}).get("labels")
    if exact and not ref:  # a scene too large for the untiled forward: the exact staged labels
        out["labels_off_pct_vs_ours_staged_fp32_cl"] = {
            k: off(v["labels"], exact) for k, v in ok.items() if k != "ours_staged_fp32_cl"}
    same_layout = ok.get("untiled_fp32_channels_last", {}).get("labels")
    if same_layout and "ours_fp32_cl" in ok:  # NHWC against NHWC: rounding alike
        out["labels_off_pct_ours_fp32_cl_vs_untiled_channels_last"] = off(
            ok["ours_fp32_cl"]["labels"], same_layout)
    if same_layout and "staged_fp32_cl" in ok:
        out["labels_off_pct_staged_fp32_cl_vs_untiled_channels_last"] = off(
            ok["staged_fp32_cl"]["labels"], same_layout)
    for mine in ("ours_fp32_cl", "staged_fp32_cl", "ours_staged_fp32_cl",
                 "ours_staged_fp32_cl_folded"):
        if mine not in ok:
            continue
        for k, v in ok.items():
            if k.startswith("monai"):
                out[f"{mine}_vs_{k}"] = {
                    "throughput_ratio": round(ok[mine]["mpix_per_s"] / v["mpix_per_s"], 3),
                    "memory_ratio": round(ok[mine]["peak_rss_sampled_mib"]
                                          / v["peak_rss_sampled_mib"], 3)}
    ours = ok.get("ours_fp32_cl")
    if ours:
        if "untiled_fp32_channels_last" in ok:
            u = ok["untiled_fp32_channels_last"]["mpix_per_s"]
            out["tiled_over_untiled_times_E"] = round(ours["mpix_per_s"] / u * ours["efficiency"],
                                                      3)
    if "ours_fp32" in ok and ours:
        base = ok["ours_fp32"]["mpix_per_s"]
        out["channels_last_speedup_fp32"] = round(ours["mpix_per_s"] / base, 3)
    return out


def write_input(path: Path, size: int) -> None:
    gen = SceneGenerator(seed=0, height=size, width=size, bands=4)
    rows = [Window(r, 0, min(1024, size - r), size) for r in range(0, size, 1024)]
    write_raster_bands(path, gen.shape, np.uint8, (gen.render(w)[0] for w in rows),
                       tile=(256, 256), compression=None, overwrite=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--tile", type=int, default=None,
                   help="our tile (input window) side; default per model: the smallest of "
                        "2048 / 3072 / 4096 with E <= 2.5")
    p.add_argument("--models", nargs="*", default=list(MODELS))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--name", default="bench_encoders", help="the result's benchmark name")
    add_harness_args(p, "1024^2, Unet-ResNet34, one run of each kind")
    p.add_argument("--budget", type=int, default=1 << 27,
                   help="staged runs: floats one stage tile holds (windows and inner maps)")
    p.add_argument("--store", default=None,
                   help="staged runs: a folder for the maps between stages (files read and "
                        "written by window); default: in memory")
    p.add_argument("--runs", nargs="*", default=None,
                   help="only these runs (e.g. untiled_fp32_channels_last staged_fp32_cl "
                        "monai_1024_0.25); default all")
    p.add_argument("--merge", type=Path, default=None,
                   help="a results JSON of other models (an earlier run) to include")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.models = 1024, ["unet_resnet34"]
        args.runs = args.runs or ["untiled_fp32", "ours_fp32_cl", "ours_staged_fp32_cl",
                                  "staged_fp32_cl", "monai_512_0.25"]
    out = args.out or RESULTS / f"{args.name}.json"
    partial = out.with_name(f"{out.stem}_partial.json")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_encoders_") as name:  # removed however it ends
        workdir = Path(name)
        base = {"size": args.size, "tile": args.tile, "threads": args.threads,
                "budget": args.budget, "runs": args.runs, "store": args.store,
                "image": str(workdir / "image.tif"), "workdir": str(workdir)}
        write_input(Path(base["image"]), args.size)
        loads: list = [("start", os.getloadavg())]
        t0 = time.perf_counter()
        earlier = json.loads(args.merge.read_text()) if args.merge else {}
        results = dict(earlier.get("models", {}))
        loads = earlier.get("loadavg", []) + loads
        for k, m in enumerate(args.models):
            results[m] = bench_model(m, base, loads, contiguous=k == 0 and not results)
            save(args.name, {"models": results, "loadavg": loads}, partial)  # a crash keeps it
        save(args.name, {
            "what": "smp networks: exact tiled prediction (predict_raster, file to file) vs the "
                    "untiled forward and MONAI's Gaussian sliding window, same model, same run",
            "targets": "throughput ours/MONAI >= 1.2; peak RSS ours/MONAI <= 0.25; 0 labels off "
                       "the untiled result; tiled >= 0.9 / E of untiled",
            "method": __doc__.split("Setup:")[1].strip(),
            "config": {k: v for k, v in base.items() if k not in ("image", "workdir")},
            "wall_s": round(time.perf_counter() - t0) + earlier.get("wall_s", 0),
            "loadavg": loads, "models": results}, out)
        partial.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
