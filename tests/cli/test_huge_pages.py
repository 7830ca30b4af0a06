"""The entry points (seg_at_scale.cli, imported before torch) back large CPU tensors with
transparent huge pages under glibc's malloc, not under tcmalloc; importing seg_at_scale alone
changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from seg_at_scale.cli.malloc import find_tcmalloc

ROOT = Path(__file__).resolve().parents[2]
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

pytestmark = pytest.mark.slow  # make test-slow: a start-up mechanism, in fresh interpreters

PROBE = """
import resource, seg_at_scale.cli, torch
import os
for _ in range(2):  # the second allocation is the steady state
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(64 << 20, dtype=torch.uint8)
    t.fill_(1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    del t
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), faults)
"""


def faults_per_64_mib(env_value: str | None, preload: str | None = None) -> tuple[str, int]:
    # glibc's malloc, which maps a freed block afresh (tcmalloc would reuse it: no faults)
    env = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "LD_PRELOAD")}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    if preload is not None:
        env["LD_PRELOAD"] = preload
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="the kernel offers no transparent huge pages")
def test_large_tensors_take_huge_pages_unless_the_user_opts_out():
    small_pages = (64 << 20) // 4096  # 16384 faults when every 4 KiB page faults alone
    value, faults = faults_per_64_mib(None)
    assert value == "1" and faults < small_pages / 8, faults
    value, faults = faults_per_64_mib("0")
    assert value == "0" and faults > small_pages / 2, faults


def test_importing_the_package_sets_no_variable_and_registers_no_resolver():
    probe = ("import os, seg_at_scale, seg_at_scale.io, seg_at_scale.tiling\n"
             "from omegaconf import OmegaConf\n"
             "print(os.environ.get('THP_MEM_ALLOC_ENABLE'),"
             " OmegaConf.has_resolver('seg.class_weights'))\n"
             "import seg_at_scale.cli\n"
             "print(OmegaConf.has_resolver('seg.class_weights'))")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["None", "False", "True"]


@pytest.mark.skipif(find_tcmalloc() is None, reason="no tcmalloc installed "
                    "(apt-get install libtcmalloc-minimal4)")
def test_under_tcmalloc_no_huge_pages_are_asked_for_unless_the_user_does():
    """tcmalloc keeps freed memory for the next tensors: whole 2 MiB pages would only make
    the first faults dearer (seg-predict 8192^2: 12.2-12.4 s with them, 11.3-11.4 without)."""
    lib = str(find_tcmalloc())
    assert faults_per_64_mib(None, preload=lib)[0] == "None"
    assert faults_per_64_mib("1", preload=lib)[0] == "1"  # the user's choice stands


@pytest.mark.skipif(find_tcmalloc() is None, reason="no tcmalloc installed "
                    "(apt-get install libtcmalloc-minimal4)")
def test_a_benchmark_runs_torch_as_the_commands_do():
    """``experiments/as_commands``: re-executed under tcmalloc without huge pages, or with
    them under glibc's malloc, as a command would be."""
    probe = ("import sys; sys.path.insert(0, 'experiments'); import as_commands, os\n"
             "from seg_at_scale.cli.malloc import allocator\n"
             "print(allocator(), os.environ.get('THP_MEM_ALLOC_ENABLE'))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("THP_MEM_ALLOC_ENABLE", "LD_PRELOAD", "SEG_AT_SCALE_MALLOC")}
    runs = {}
    for choice in ("auto", "system"):
        runs[choice] = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True,
                                      env={**env, "SEG_AT_SCALE_MALLOC": choice},
                                      capture_output=True, text=True).stdout.split()
    offered = THP.exists() and "[never]" not in THP.read_text()
    assert runs == {"auto": ["tcmalloc", "None"],
                    "system": ["system", "1" if offered else "None"]}
