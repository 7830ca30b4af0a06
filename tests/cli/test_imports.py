"""What a command's start imports: every subprocess test and every rank pays it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_seg_predict_starts_without_the_libraries_only_polygons_or_compiling_need():
    """scipy (0.3 s here), pyogrio and geopandas load when polygons are written, not when
    ``seg-predict`` starts (scipy was loaded through the catalog's import of the vectors);
    ``torch._dynamo`` (1 s) when ``compile`` compiles a shape, and pyarrow (with its
    allocator's thread) when a polygon file is written, not with the prediction modules
    every run, ``seg-train`` and Slurm rank imports (pyarrow was, through the vectors)."""
    code = ("import sys, seg_at_scale.cli.predict\n"
            "print(sorted(m for m in ('scipy', 'pyogrio', 'geopandas', 'pyarrow')"
            " if m in sys.modules))\n"
            "import seg_at_scale.prediction.archive, seg_at_scale.prediction.scene\n"
            "print('torch._dynamo' in sys.modules, 'pyarrow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-2:] == ["[]", "False False"], out.stdout


KEPT_OUT = """
import os, sys
import seg_at_scale.cli.common as common

def loading(main):  # in place of the command's run: what loading an smp or timm model imports
    import timm
    print('wandb' in sys.modules, sorted(p for p in os.listdir(os.environ['TMPDIR'])
                                         if 'wandb' in p))
    os._exit(0)

common.exit_now = loading
from seg_at_scale.cli.predict import entry
entry()
"""


def test_seg_predict_keeps_wandb_out_which_timm_imports_and_its_exit_would_leave_behind(
        tmp_path):
    """timm imports wandb when installed: 0.6-1 s of every smp or timm model's prediction,
    and two folders in the temporary folder that ``seg-predict``'s immediate exit (no
    interpreter teardown) left behind, one pair per run. The command refuses the import;
    timm goes on without it."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = subprocess.run([sys.executable, "-c", KEPT_OUT], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "TMPDIR": str(scratch)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "[]"], out.stdout


BLOCK = """
import gc
from seg_at_scale.cli.common import long_lived
{before}
with long_lived():
    import torch
frozen = gc.get_freeze_count()
class Cycle:
    pass
made = Cycle()
made.me = made
with long_lived():  # a second command in this process (a sweep's next trial)
    later = Cycle()
    later.me = later
del made, later
print(frozen, gc.get_freeze_count(), gc.isenabled(), gc.collect())
"""


def _block(before: str = "") -> list[str]:
    out = subprocess.run([sys.executable, "-c", BLOCK.format(before=before)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


@pytest.mark.slow  # make test-slow: a start-up mechanism, in fresh interpreters
def test_the_stack_leaves_the_collector_once_and_what_the_run_makes_stays_in_it():
    """torch's objects are frozen by the first block; the second freezes nothing, so the
    cycles made after the first are collected, not kept for the process's life."""
    frozen, again, enabled, collected = _block()
    assert int(frozen) > 100_000  # torch's modules, classes and functions
    assert again == frozen
    assert enabled == "True"
    assert int(collected) >= 2


@pytest.mark.slow  # make test-slow: a start-up mechanism, in fresh interpreters
def test_a_collector_the_user_switched_off_stays_off():
    frozen, _, enabled, _ = _block("gc.disable()")
    assert int(frozen) > 100_000
    assert enabled == "False"


COMMAND = """
import gc, sys
from seg_at_scale.cli.{module} import main
sys.argv = {argv!r}
try:
    main()
except SystemExit as exc:
    print("exit", exc.code)
print(gc.get_freeze_count(), gc.isenabled())
"""


@pytest.mark.slow  # make test-slow: a start-up mechanism, in fresh interpreters
def test_both_commands_import_the_stack_as_long_lived_objects(tmp_path):
    """``seg-train`` and ``seg-predict`` refused after the network stack's import (an unknown
    ``predict.`` key, a missing run): its objects left the collector, which runs again."""
    cases = {"train": ["seg-train", f"hydra.run.dir={tmp_path / 'run'}", "+predict.colour=red"],
             "predict": ["seg-predict", f"run={tmp_path / 'no_run'}",
                         f"image={tmp_path / 'a.tif'}", f"output={tmp_path / 'a_mask.tif'}"]}
    for module, argv in cases.items():
        out = subprocess.run([sys.executable, "-c", COMMAND.format(module=module, argv=argv)],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "SEG_DATA_DIR": str(tmp_path / "data")})
        lines = out.stdout.strip().splitlines()
        assert lines[-2] == "exit 2", (module, out.stdout[-1000:], out.stderr[-2000:])
        frozen, enabled = lines[-1].split()
        assert int(frozen) > 100_000, module
        assert enabled == "True", module


def test_a_kept_out_module_is_refused_naming_it_as_not_installed(monkeypatch):
    """``keep_out``: an import of the module raises ModuleNotFoundError naming it, which a
    library's ``try: import`` and ``importlib.util.find_spec`` take for "not installed"."""
    import importlib.util

    from seg_at_scale.cli.common import keep_out

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the finder goes with it
    keep_out("seg_kept_out_probe")
    with pytest.raises(ModuleNotFoundError, match=r"does not use 'seg_kept_out_probe' and "
                       r"keeps it out of its process") as err:
        import seg_kept_out_probe  # noqa: F401
    assert err.value.name == "seg_kept_out_probe"
    with pytest.raises(ModuleNotFoundError, match="seg_kept_out_probe"):
        importlib.util.find_spec("seg_kept_out_probe")
