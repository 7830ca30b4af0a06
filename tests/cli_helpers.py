"""``seg-train`` in a subprocess, for the tests that run the real entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def assert_plain_checkpoints(folder: Path) -> int:
    """Every checkpoint under ``folder`` loads with ``weights_only=True`` (plain data only).

    Every test that trains through ``seg-train`` checks it: each model family, pipeline,
    memory mode and precision the suite trains writes checkpoints that open without running
    code from the file.
    """
    from seg_at_scale.models.checkpoint import load_checkpoint

    found = sorted(folder.rglob("*.ckpt"))
    for path in found:
        load_checkpoint(path)  # raises naming the Python global it would need
    return len(found)


def run_train(tmp: Path, run: str, *overrides: str, timeout: int = 400,
              env: dict[str, str] | None = None) -> dict:
    """``seg-train`` in a subprocess (data under ``tmp/data``); its summary plus its log.

    ``env`` adds variables to the otherwise bare environment (e.g. a GPU machine's
    ``CUDA_VISIBLE_DEVICES`` or ``LD_LIBRARY_PATH``).
    """
    cmd = [sys.executable, "-m", "seg_at_scale.cli.train", f"hydra.run.dir={tmp / run}",
           *overrides]
    env = {**(env or {}), "SEG_DATA_DIR": str(tmp / "data"), "PATH": "/usr/bin:/bin",
           "WANDB_MODE": "offline"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_plain_checkpoints(tmp / run)
    return json.loads((tmp / run / "summary.json").read_text()) | {"log": out.stdout + out.stderr}
