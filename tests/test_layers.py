"""The package's layers and acyclic packages, as pyproject.toml's [tool.importlinter]
declares them: entry points > prediction / tasks > models / data / vectors / catalog >
tiling / io > errors, function-level imports included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert out.stdout.count(" KEPT") == 2, out.stdout


def test_a_lower_layer_importing_a_higher_one_breaks_the_contract(tmp_path):
    """The contract can fail: a copy of the package whose tiling imports the CLI."""
    import shutil

    pkg = tmp_path / "seg_at_scale"
    shutil.copytree(ROOT / "seg_at_scale", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "tiling" / "bad.py").write_text("from seg_at_scale.cli import common\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint)], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 1, out.stdout[-2000:]
    assert "seg_at_scale.tiling is not allowed to import seg_at_scale.cli" in out.stdout
