"""tcmalloc preloaded by the commands (seg_at_scale.cli.malloc): who gets it, the choice
users make with SEG_AT_SCALE_MALLOC, and a command under it writing the same bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.prediction import env, predict_cmd

from seg_at_scale.cli.malloc import (
    ENV,
    allocator,
    find_tcmalloc,
    is_command,
    preloaded_library,
)


@pytest.mark.parametrize(("argv", "command"), [
    (["python", "-m", "seg_at_scale.cli.train", "model=unet"], True),
    (["python", "-X", "dev", "-u", "-m", "seg_at_scale.cli.synth"], True),
    (["/v/bin/python3", "/v/bin/seg-predict", "image=a.tif"], True),
    (["/v/bin/python3", "/v/bin/seg-export"], True),
    (["python", "-m", "seg_at_scale.cli.runs"], False),  # not a command of its own
    (["python", "-m", "pytest", "-q"], False),
    (["python", "-c", "import seg_at_scale.cli"], False),
    (["python", "experiments/bench_feed.py"], False),
    (["python"], False),
])
def test_only_a_command_starting_is_re_executed(argv, command):
    assert is_command(argv) is command


def test_the_users_choice_and_preload_are_honoured(tmp_path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    assert preloaded_library({ENV: "system"}) is None
    assert preloaded_library({ENV: str(lib)}) == lib
    # an LD_PRELOAD the user set (jemalloc, a profiler) is theirs: left as it is
    assert preloaded_library({ENV: str(lib), "LD_PRELOAD": "/x/libjemalloc.so.2"}) is None
    assert preloaded_library({}) == find_tcmalloc({})
    assert preloaded_library({ENV: "auto"}) == find_tcmalloc({})
    with pytest.raises(ValueError, match=rf"{ENV}='{tmp_path}/nope.so': no such file; give "
                                         "the path of a malloc library .* 'auto' .* 'system'"):
        preloaded_library({ENV: str(tmp_path / "nope.so")})


def test_a_missing_library_is_refused_before_any_work(cli_case, tmp_path):
    """A fresh command (the check runs as it starts): exit 2, one line naming the variable,
    its value and the fix; no output, no store."""
    run, image = cli_case
    out = tmp_path / "mask.tif"
    proc = subprocess.run(predict_cmd(run, image, out),
                          env={**env(), ENV: str(tmp_path / "libnope.so")},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"seg-predict: error: {ENV}='{tmp_path}/libnope.so': no such file; give the path of "
        "a malloc library (libtcmalloc_minimal.so.4), 'auto' (tcmalloc where installed) or "
        "'system' (glibc's)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.skipif(bool(os.environ.get("LD_PRELOAD")), reason="pytest runs with LD_PRELOAD")
def test_this_process_is_not_re_executed_by_importing_the_commands():
    """pytest imported seg_at_scale.cli (conftest, the tests): not a command, so glibc's."""
    assert "seg_at_scale.cli" in sys.modules
    assert allocator() == "system"


@pytest.mark.skipif(find_tcmalloc() is None,
                    reason="no tcmalloc installed (apt-get install libtcmalloc-minimal4)")
def test_a_fresh_command_runs_under_tcmalloc_and_writes_the_same_bytes(cli_case,
                                                                       cli_reference,
                                                                       tmp_path):
    """``seg-predict`` started fresh re-executes itself with tcmalloc preloaded (same pid:
    its parent waits on it) and writes the bytes of the glibc run (the warm reference)."""
    run, image = cli_case
    out = tmp_path / "mask.tif"
    proc = subprocess.run(predict_cmd(run, image, out, "tile_size=64"), env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert res["allocator"] == "tcmalloc"
    assert "tcmalloc" not in proc.stderr  # no large-allocation reports
    assert Path(out).read_bytes() == cli_reference.read_bytes()
