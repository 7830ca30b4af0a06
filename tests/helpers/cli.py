"""``seg-train`` in a subprocess, for the tests that run the real entry point."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from helpers import warm

#: the training configs (seg_at_scale/conf)
CONF = str(Path(__file__).resolve().parents[2] / "seg_at_scale" / "conf")
#: the smallest training run the CLI tests share: a tiny U-Net on 157 x 189 scenes
TINY = ["trainer=fast", "logger=csv", "model=unet_tiny", "data.synthetic.height=157",
        "data.synthetic.width=189", "data.synthetic.splits={train:2,val:1,test:1}",
        "tiling.tile_size=96", "predict.tile_size=96"]


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
    out = warm.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    # Lightning's "`weights_only` was not set, defaulting to `False`" (a save of the
    # resume state, read by users as a load that runs code): every save says what it keeps
    assert "`weights_only` was not set" not in out.stdout + out.stderr
    # nor warnings about what is neither the user's nor the project's: Lightning's hint to
    # use srun on a machine with Slurm's tools and no Slurm job (this one, under .ci/run),
    # torch's deprecation of the pytree class Lightning uses, Lightning's advertisement,
    # wandb's warning about the setting Lightning passes it
    for noise in ("The `srun` command is available", "`isinstance(treespec, LeafSpec)`",
                  "💡 Tip:", "The anonymous setting has no effect"):
        assert noise not in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
    assert_plain_checkpoints(tmp / run)
    return json.loads((tmp / run / "summary.json").read_text()) | {"log": out.stdout + out.stderr}


def run_here(main: Callable[[], object], argv: list[str], cwd: Path | None = None,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A console script's ``main`` run in this process, for refusals that happen before any
    work (no new Python: ~0.1 s, not the 3-6 s of importing torch and Lightning again).

    The same entry point as the console script: the override precheck, Hydra, the one-line
    error wrapper and its exit status; ``argv``, the working folder and ``env`` are set for
    the call and restored; stdout and stderr are captured.
    """
    from hydra.core.global_hydra import GlobalHydra

    out, err = io.StringIO(), io.StringIO()
    saved_argv, here, saved_env = sys.argv, os.getcwd(), dict(os.environ)
    code = 0
    try:
        sys.argv = list(argv)
        os.environ.update(env or {})
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as exc:
                code = int(exc.code or 0) if not isinstance(exc.code, str) else 1
    finally:
        sys.argv = saved_argv
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved_env)
        GlobalHydra.instance().clear()
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def seg_train_here(tmp: Path, *overrides: str, env: dict[str, str] | None = None
                   ) -> subprocess.CompletedProcess:
    """``seg-train`` in this process (data under ``tmp/data``), for its refusals."""
    from seg_at_scale.cli.train import main

    return run_here(main, ["seg-train", *overrides],
                    env={"SEG_DATA_DIR": str(tmp / "data"), "WANDB_MODE": "offline",
                         **(env or {})})
