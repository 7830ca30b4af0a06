"""The built wheel is enough: configs ship inside it, and ``seg-train`` runs from an empty
folder of a fresh environment that has the wheel and nothing of the checkout."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAST = ["trainer=fast", "logger=csv", "model=unet_tiny", "data.synthetic.height=96",
        "data.synthetic.width=96", "data.synthetic.splits={train:1,val:1,test:1}",
        "tiling.tile_size=64", "predict.tile_size=64", "tiling.samples_per_epoch=4",
        "tiling.batch_size=2"]


def sh(*cmd: str | Path, **kw: object) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600,
                         **kw)  # type: ignore[call-overload]
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_wheel_installs_and_trains_from_an_empty_folder(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: building leaves build/ and *.egg-info behind
    shutil.copytree(ROOT / "seg_at_scale", src / "seg_at_scale",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
       "-w", tmp_path / "dist", src)
    wheel = next((tmp_path / "dist").glob("seg_at_scale-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "seg_at_scale/conf/train.yaml" in names
    assert "seg_at_scale/conf/experiment/unet2015.yaml" in names
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA")))
    assert b"License-Expression: Apache-2.0" in meta.splitlines()  # SPDX, not a free text
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)

    venv = tmp_path / "venv"  # fresh; the dependencies come from this interpreter's
    sh(sys.executable, "-m", "venv", venv)
    py = venv / "bin" / "python"
    own = Path(sh(py, "-c", "import site; print(site.getsitepackages()[0])").stdout.strip())
    (own / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    sh(py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel)

    empty = tmp_path / "empty"
    empty.mkdir()
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path),
           "WANDB_MODE": "offline", "SEG_DATA_DIR": str(empty / "data")}
    where = sh(py, "-c", "import seg_at_scale; print(seg_at_scale.__file__)", cwd=empty,
               env=env).stdout.strip()
    assert where.startswith(str(own)), where  # the wheel's copy, not the checkout
    sh(venv / "bin" / "seg-train", *FAST, "hydra.run.dir=run", cwd=empty, env=env)
    summary = json.loads((empty / "run" / "summary.json").read_text())
    assert 0.0 <= summary["test"][0]["miou"] <= 1.0
    assert not os.path.commonpath([summary["run"], str(ROOT)]) == str(ROOT)
