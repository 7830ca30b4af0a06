"""experiments/bench_gpu.py on this CPU with --quick: every section gives sane figures.

The GPU run is the point of the script; this keeps its harness from rotting. The script
runs as a subprocess on the checkout under test (``PYTHONPATH``) under glibc's malloc with
its mmap threshold fixed, so that freed tensors leave the resident set and CPU peaks are
measurable: not under the preload ``make test`` runs the suite with (tcmalloc keeps freed
memory for the next tensors, so a repeated step's resident set does not grow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from seg_at_scale.memory.precision import cpu_supports

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = {"matmul_peak", "unet_forward", "prediction", "train_step", "largest_tile",
            "offload_cost", "ibm_gscnn", "pipeline", "encoders"}


def bench(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(PYTHONPATH=str(ROOT), MALLOC_MMAP_THRESHOLD_="131072")
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_gpu.py"), *args],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp)


def values(doc: Any, key: str) -> Iterator[Any]:
    """Every value stored under ``key`` anywhere in a JSON document."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            if k == key:
                yield v
            yield from values(v, key)
    elif isinstance(doc, list):
        for v in doc:
            yield from values(v, key)


def positive(*xs: Any) -> bool:
    return all(isinstance(x, (int, float)) and x > 0 for x in xs)


@pytest.mark.slow  # make test-all; the property is also proven by faster tests
@pytest.mark.skipif(not cpu_supports(torch.bfloat16), reason=(
    "this CPU has no bfloat16 kernels (AVX2 alone): the sections' bf16 runs are emulated, "
    "10x-270x slower than float32 (bench_fast_precision), and the quick CPU run takes more "
    "than its 10 minutes"))
def test_quick_cpu_run_gives_every_section(tmp_path):
    out = tmp_path / "bench_gpu.json"
    proc = bench(tmp_path, "--device", "cpu", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert list(values(doc, "error")) == [], list(values(doc, "traceback"))
    s = doc["sections"]
    assert set(s) == SECTIONS and doc["device"]["type"] == "cpu" and doc["device"]["name"]
    assert len(doc["device"]["loadavg_start"]) == 3 and doc["device"]["torch"] == torch.__version__

    assert positive(s["matmul_peak"]["fp32"], s["matmul_peak"]["bf16"])
    assert s["matmul_peak"]["tf32"] is None  # no TF32 on a CPU
    models = s["unet_forward"]["models"]
    assert set(models) == {"small", "medium", "large"}
    for row in models.values():
        runs = [v for v in row.values() if isinstance(v, dict)]
        assert {k for k, v in row.items() if isinstance(v, dict)} == {
            "fp32_eager", "fp32_compiled", "bf16_eager", "bf16_compiled"}
        assert positive(row["gflop_per_mpix"], *(r["s"] for r in runs),
                        *(r["fraction_of_peak"] for r in runs))

    p = s["prediction"]
    assert positive(p["streaming"]["mpix_per_s"], p["bare_batch1"]["mpix_per_s"],
                    p["streaming_vs_bare"]) and p["tiles"] > 1
    assert positive(*(p["io_alone"][k] for k in ("read_s", "read_mpix_per_s", "write_cog_s",
                                                 "write_cog_mpix_per_s", "threads")))
    prof = p["profile"]
    assert positive(prof["wall_s"]) and prof["device_busy_fraction"] is None  # no device
    assert len(prof["top_self_cpu"]) >= 3 and positive(prof["top_self_cpu"][0]["self_cpu_ms"])
    arch = p["archive"]
    assert arch["scenes"] == 16 and positive(arch["archive_mpix_per_s"],
                                             arch["alone_mpix_per_s"], arch["archive_over_alone"])

    for side in map(str, doc["sizes"]["train_sides"]):
        row = s["train_step"][side]
        assert row["untiled"]["fits"] and row["tiled"]["fits"]
        assert positive(row["untiled"]["step_s"], row["tiled"]["step_s"], row["time_ratio"],
                        row["untiled"]["peak_mib"], row["tiled"]["peak_mib"],
                        row["memory_ratio"], row["E"])

    tiles = s["largest_tile"]["modes"]
    assert set(tiles) == set(doc["sizes"]["tile_modes"])
    for f in tiles.values():
        assert positive(f["side"], f["s_per_mpix"], f["time_vs_none"], f["side_vs_none"])
        assert f["side"] <= doc["sizes"]["max_side"] and len(f["probes"]) >= 2

    modes = s["offload_cost"]["modes"]
    assert positive(*(m["step_s"] for m in modes.values()), modes["offload"]["time_vs_none"],
                    modes["checkpoint_offload"]["time_vs_checkpoint"])
    ibm = s["ibm_gscnn"]["modes"]
    assert set(ibm) == {"none", "checkpoint:block", "offload", "checkpoint_offload:block"}
    assert positive(*(m["step_s"] for m in ibm.values()))
    # on a CPU the peak is the resident set's growth: 0 where a mode reuses what the one
    # before freed (seen for the last mode, checkpoint_offload:block)
    assert all(isinstance(m["peak_mib_with_state"], float) and m["peak_mib_with_state"] >= 0
               for m in ibm.values()) and positive(ibm["none"]["peak_mib_with_state"])

    enc = s["encoders"]["models"]
    assert set(enc) == {"unet_resnet34", "deeplabv3plus_resnet50"}
    for row in enc.values():
        runs = {k: v for k, v in row.items() if isinstance(v, dict)}
        assert set(runs) == {"untiled_fp32", "untiled_fp32_cl", "ours_fp32_cl", "ours_bf16",
                             "ours_auto_fp32", "ours_auto_bf16", "auto_tile",
                             "monai_512_0.25", "monai_1024_0.25"}
        runs.pop("auto_tile")
        assert runs["ours_auto_fp32"]["labels_off_pct"] <= 0.01  # exact, but for float ties
        assert positive(*(r["mpix_per_s"] for r in runs.values()))
        # on a CPU the peak is the resident set's growth, 0 where freed memory is reused
        assert all(isinstance(r["peak_mib"], float) and r["peak_mib"] >= 0
                   for r in runs.values())
        assert runs["untiled_fp32"]["labels_off_pct"] == 0.0  # the reference itself
        assert runs["ours_fp32_cl"]["labels_off_pct"] <= 0.01  # exact, but for float ties

    pipe = s["pipeline"]
    assert positive(pipe["plain_step_s"], *(v["speed_vs_plain"] for v in
                                            pipe["pipeline_1"].values()))
    assert [v["balance"] for v in pipe["planner"].values()][0] == [pipe["layers"]]
    assert positive(*(v["ratio"] for v in pipe["planner"].values()))


@pytest.mark.slow  # make test-slow: bench_gpu's harness, in a fresh interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_without_cuda_and_quick_it_says_so_and_writes_nothing(tmp_path):
    out = tmp_path / "bench_gpu.json"
    proc = bench(tmp_path, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no CUDA device here" in proc.stdout and "--device cpu --quick" in proc.stdout
    assert not out.exists()


def test_the_gpu_check_collects_every_file_that_holds_a_cuda_test():
    """``make gpu-check`` collects only ``GPU_TESTS`` (a lent machine may lack packages that
    only the CPU suite imports): a CUDA test in another file would silently not run there."""
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        from bench_gpu import GPU_TESTS
    finally:
        sys.path.remove(str(ROOT / "experiments"))
    holding = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                     if p != Path(__file__)
                     and any(m in p.read_text() for m in ("ON_GPU", "mark.gpu")))
    assert holding == sorted(GPU_TESTS)
