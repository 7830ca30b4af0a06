"""The suite's warm processes (``tests/helpers/warm.py``) behave as fresh ones: the same
arguments, working folder, environment, ``sys.path``, thread count, signal handlers, exit
status, output streams; a signal ends them as it ends a fresh process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import warm

TESTS = Path(__file__).parent
PROBE = [sys.executable, "-m", "helpers.warm_probe"]

pytestmark = pytest.mark.slow  # make test-slow: the suite's own harness, against fresh interpreters


def _env(**extra: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(TESTS), "PROBE": "yes",
            "HOME": "/nowhere", **extra}


@pytest.mark.parametrize(("threads", "limits"), [
    ("1", {}), (None, {}),
    # a full disk and few open files (the fault tests' limits), no bytecode written
    (None, {"RLIMIT_FSIZE": (50_000, 50_000), "RLIMIT_NOFILE": (40, 40)})])
def test_a_warm_process_sees_what_a_fresh_one_sees(tmp_path, monkeypatch, threads, limits):
    monkeypatch.delenv("SEG_TEST_COLD", raising=False)
    env = _env(**({"OMP_NUM_THREADS": threads} if threads else {}),
               **({"PYTHONDONTWRITEBYTECODE": "1"} if limits else {}))
    args = ["3", "a b", "key=value"]
    fresh = subprocess.run([*PROBE, *args], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=120,
                           preexec_fn=lambda: warm._set_limits(limits))
    started = warm.run([*PROBE, *args], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120, limits=limits)
    assert (started.returncode, fresh.returncode) == (3, 3), started.stderr + fresh.stderr
    assert json.loads(started.stdout) == json.loads(fresh.stdout)
    assert started.stderr == fresh.stderr == "to stderr\n"
    assert json.loads(started.stdout)["argv"] == args
    if limits:
        assert json.loads(started.stdout)["file_size"] == [50_000, 50_000]


def test_a_warm_process_takes_sigint_as_the_caller_passes_it_on(tmp_path, monkeypatch):
    """A fresh Python keeps SIGINT ignored when its parent ignores it (a suite started in
    the background), and otherwise installs its KeyboardInterrupt handler (the signal
    module's documented start-up); a warm one does the same, whatever its caller did when
    the server started. Both states are checked, so one differs from the server's own."""
    monkeypatch.delenv("SEG_TEST_COLD", raising=False)
    seen = []
    for handler in (signal.SIG_IGN, signal.default_int_handler):
        before = signal.signal(signal.SIGINT, handler)
        try:
            started = warm.run([*PROBE, "0"], capture_output=True, text=True, env=_env(),
                               cwd=tmp_path, timeout=120)
        finally:
            signal.signal(signal.SIGINT, before)
        seen.append(json.loads(started.stdout)["sigint"])
    assert seen == [False, True]


def test_the_suites_processes_keep_their_measurements_in_the_runs_cache(tmp_path, own_cache,
                                                                        monkeypatch):
    """A command the suite starts with a bare environment, fresh or warm, keeps layouts.json
    and compile.json in this run's cache, not in the user's ``~/.cache``."""
    monkeypatch.delenv("SEG_TEST_COLD", raising=False)
    code = "from seg_at_scale.prediction.layout_choice import cache_path; print(cache_path())"
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, timeout=120)
    assert fresh.stdout.strip() == str(own_cache / "layouts.json"), fresh.stderr
    started = warm.run([*PROBE, "0"], capture_output=True, text=True, env=_env(),
                       cwd=tmp_path, timeout=120)
    assert json.loads(started.stdout)["cache"] == str(own_cache)
    # pytest's temporary folders of this run (its workers' common parent), not the user's
    assert own_cache.is_relative_to(tmp_path.parents[1])
    assert not own_cache.is_relative_to(Path.home() / ".cache")


def test_a_warm_process_is_a_process_of_its_own_that_signals_end(tmp_path, monkeypatch):
    monkeypatch.delenv("SEG_TEST_COLD", raising=False)
    out = open(tmp_path / "out.txt", "w")  # noqa: SIM115 - closed below
    procs = [start([*PROBE, "0", "sleep"], env=_env(), stdout=out, stderr=subprocess.STDOUT)
             for start in (warm.popen, subprocess.Popen)]
    try:
        assert isinstance(procs[0], warm.WarmProcess)
        end = time.monotonic() + 120
        while (tmp_path / "out.txt").read_text().count("to stderr") < 2:
            assert time.monotonic() < end and all(p.poll() is None for p in procs)
            time.sleep(0.05)
        assert procs[0].pid not in (os.getpid(), procs[1].pid)
        for p, sig in zip(procs, (signal.SIGTERM, signal.SIGTERM), strict=True):
            p.send_signal(sig)
        assert [p.wait(timeout=60) for p in procs] == [-signal.SIGTERM] * 2
    finally:
        out.close()
        for p in procs:
            p.kill()


def test_cold_starts_every_command_fresh(monkeypatch):
    monkeypatch.setenv("SEG_TEST_COLD", "1")
    proc = warm.popen([*PROBE, "0"], env=_env(), stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL)
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=120) == 0


def test_the_server_passes_over_an_absent_library_but_not_a_broken_module(tmp_path,
                                                                         monkeypatch):
    # the lent GPU machine has no imagecodecs: the server did not start there at all
    absent = "seg_at_scale_test_absent_library"
    (tmp_path / "broken_for_the_test.py").write_text(f"import {absent}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    warm.preload(["json", absent])
    assert absent not in sys.modules
    with pytest.raises(ModuleNotFoundError, match=absent) as info:
        warm.preload(["broken_for_the_test"])
    assert info.value.name == absent
