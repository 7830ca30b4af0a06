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


def _glibc_env(**more: str) -> dict[str, str]:
    """This environment without a preload (``make test`` runs the suite under tcmalloc)."""
    return {**{k: v for k, v in os.environ.items()
               if k not in ("LD_PRELOAD", ENV) and not k.startswith("TCMALLOC_")}, **more}


def test_a_script_is_not_re_executed_by_importing_the_commands():
    """A Python script (a notebook, pytest) that imports seg_at_scale.cli: not a command, so
    glibc's malloc, in the same process."""
    code = ("import os, sys; pid = os.getpid(); import seg_at_scale.cli; "
            "from seg_at_scale.cli.malloc import allocator; "
            "print(allocator(), os.getpid() == pid, 'LD_PRELOAD' in os.environ)")
    out = subprocess.run([sys.executable, "-c", code], env=_glibc_env(), capture_output=True,
                         text=True, timeout=60)
    assert (out.returncode, out.stdout.split()) == (0, ["system", "True", "False"]), out.stderr


@pytest.mark.slow  # make test-slow: a start-up mechanism, in fresh interpreters
@pytest.mark.skipif(find_tcmalloc() is None,
                    reason="no tcmalloc installed (apt-get install libtcmalloc-minimal4)")
def test_run_under_starts_a_program_under_the_commands_malloc_as_the_user_chooses(tmp_path):
    """``make test`` runs pytest so: tcmalloc by default, glibc's when the user says
    ``system``, a missing library refused in one line before the program starts."""
    probe = ("from seg_at_scale.cli.malloc import allocator; import os; "
             "print(allocator(), os.environ.get('TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD'))")
    launch = "import sys; from seg_at_scale.cli.malloc import run_under; run_under(sys.argv[1:])"

    def under(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", launch, sys.executable, "-c", probe],
                              env=_glibc_env(**env), capture_output=True, text=True,
                              timeout=60)

    assert under().stdout.split() == ["tcmalloc", str(1 << 60)]  # its large-allocation
    assert under(**{ENV: "system"}).stdout.split() == ["system", "None"]  # reports off
    refused = under(**{ENV: str(tmp_path / "libnope.so")})
    assert (refused.returncode, refused.stdout) == (2, "")
    assert refused.stderr.strip() == (
        f"{sys.executable}: error: {ENV}='{tmp_path}/libnope.so': no such file; give the "
        "path of a malloc library (libtcmalloc_minimal.so.4), 'auto' (tcmalloc where "
        "installed) or 'system' (glibc's)")


@pytest.mark.slow  # make test-slow: a start-up mechanism, in fresh interpreters
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
