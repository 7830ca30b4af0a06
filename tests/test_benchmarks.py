"""Every benchmark of ``experiments/`` runs its quick smoke run and writes the one schema.

``make bench-smoke`` (``-m bench``; the default run leaves these out). Each test runs
``experiments/bench.py <name> --quick --out <tmp>/r.json`` in a subprocess, as a person
would, and checks the exit status and the JSON: the keys ``common.save`` writes, and at
least one figure beyond them. A benchmark this machine cannot run (``bench_gpu`` without
CUDA, ``bench_slurm`` without Slurm, ``bench_allocator`` without tcmalloc) must say
``skipped: ...`` on one line, exit 0 and write nothing. ``bench_feed`` without GDAL's tools
(``gdal-bin``, which ``.ci/run`` installs) runs its bare-model comparison alone. A run leaves
nothing in its temporary folder (``TMPDIR``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "experiments" / "bench.py"
SCHEMA = ("benchmark", "commit", "date", "machine", "loadavg_at_save")


def _names() -> list[str]:
    sys.path.insert(0, str(BENCH.parent))
    try:
        import bench
    finally:
        sys.path.pop(0)
    return list(bench.benchmarks())


def _cannot_run(name: str) -> str | None:
    """Why this machine cannot run benchmark ``name``, or None."""
    if name == "bench_gpu":
        import torch

        return None if torch.cuda.is_available() else "needs CUDA"
    if name == "bench_allocator":
        from seg_at_scale.cli.malloc import find_tcmalloc

        return None if find_tcmalloc() else "no tcmalloc installed"
    if name == "bench_slurm":
        sys.path.insert(0, str(ROOT / "tests" / "slurm"))
        try:
            from cluster import unavailable
        finally:
            sys.path.pop(0)
        return unavailable()
    return None


def test_list_names_every_benchmark_with_its_description() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "list"], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    listed = {line.split()[0]: line.split(None, 1)[1] for line in out}
    assert list(listed) == _names()
    assert {"bench_feed", "bench_gpu", "finetune_transfer", "learn_cosmic"} <= set(listed)
    assert "gpu_common" not in listed and "common" not in listed  # helpers, not benchmarks
    assert all(len(what) > 10 for what in listed.values())


@pytest.mark.bench
@pytest.mark.parametrize("name", _names())
def test_quick_run_writes_the_schema(name: str, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    # the run's own temporary folder (short: sockets are made there), left as it was found
    # but for torch's compile cache (torchinductor_<user>, kept by design)
    scratch = Path(tempfile.mkdtemp(prefix="bench-", dir="/tmp"))
    env = {**os.environ, "CI": "true", "TMPDIR": str(scratch)}
    extra = []
    if name == "bench_feed" and shutil.which("gdal_translate") is None:
        extra = ["--skip", "gdal"]  # no GDAL tools (apt-get install gdal-bin): bare model only
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(BENCH), name, "--quick", "--out", str(out),
                               *extra], capture_output=True, text=True, timeout=600,
                              cwd=tmp_path, env=env)
        left = sorted(p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.perf_counter() - t0
    print(f"{name} --quick: {seconds:.1f} s")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert left == []  # its temporary files removed
    reason = _cannot_run(name)
    if reason:
        skips = [line for line in proc.stdout.splitlines() if line.startswith("skipped: ")]
        assert len(skips) == 1, proc.stdout[-2000:]
        assert not out.exists()
        return
    doc = json.loads(out.read_text())
    assert list(doc)[:len(SCHEMA)] == list(SCHEMA)
    assert isinstance(doc["benchmark"], str) and doc["benchmark"]
    assert isinstance(doc["machine"], dict) and doc["machine"]["cores"]
    assert len(doc["loadavg_at_save"]) == 3
    assert set(doc) - set(SCHEMA), "no figures beyond the schema"


def test_a_memory_extrapolation_needs_a_peak_that_grows_with_the_side() -> None:
    """bench_train_step fits peak = a + b * side^2 and solves it at 16 GiB. A tiled run's peak
    is flat by design, and the quick run's small sides once gave a falling fit (885 MiB at
    384, 888 at 256): ``sqrt`` of a negative ended the smoke run. Nothing is extrapolated."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        from bench_train_step import LIMIT_MIB, side_at_limit
    finally:
        sys.path.pop(0)
    assert side_at_limit(900.0, -3e-5) is None and side_at_limit(900.0, 0.0) is None
    assert side_at_limit(LIMIT_MIB + 1.0, 1e-3) is None  # already past the limit
    side = side_at_limit(700.0, 2e-4)
    assert side is not None and 700.0 + 2e-4 * side**2 <= LIMIT_MIB < 700.0 + 2e-4 * (side + 1) ** 2
