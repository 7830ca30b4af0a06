"""Stopping a training run without losing it: SIGTERM, Ctrl+C, SLURM's requeue.

* **SIGTERM** (what SLURM, Kubernetes and ``kill`` send before a kill): Lightning's own
  handler marks it and its loops raise ``SIGTERMException`` at the next batch boundary;
  :class:`SaveOnStop` then writes ``checkpoints/last.ckpt``, which a rerun into the run
  folder resumes from (``ckpt_path=auto``).
* **SIGINT** (Ctrl+C): the first one is turned into the same orderly stop (Lightning would
  otherwise raise ``KeyboardInterrupt`` wherever the program is, e.g. inside an optimiser
  step, and save nothing); a second one interrupts at once.
* **SLURM**: :func:`slurm_plugins` gives Lightning's ``SLURMEnvironment`` with
  ``auto_requeue``: on the requeue signal (``sbatch --signal=USR1@90``) Lightning saves
  ``hpc_ckpt_<n>.ckpt`` in the run folder and runs ``scontrol requeue``; the requeued job
  resumes from it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import pytorch_lightning as pl
from lightning_fabric.plugins.environments import SLURMEnvironment
from pytorch_lightning.utilities.exceptions import SIGTERMException

from seg_at_scale.errors import ConfigError

__all__ = ["SaveOnStop", "slurm_plugins", "newest_checkpoint", "SIGTERMException"]

log = logging.getLogger(__name__)


class SaveOnStop(pl.Callback):
    """Save ``<dirpath>/last.ckpt`` when SIGTERM or Ctrl+C stops training.

    Attributes:
        signal: the signal that stopped the run (``signal.SIGTERM`` / ``SIGINT``), or None.
        path: where the checkpoint goes.
    """

    def __init__(self, dirpath: str | os.PathLike[str]) -> None:
        self.path = Path(dirpath) / "last.ckpt"
        self.signal: int | None = None
        self._previous: Any = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        """First Ctrl+C: stop like SIGTERM, at the next batch boundary; second: at once."""
        if self.signal == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signal.SIGINT
        log.warning("Ctrl+C: stopping after this step and saving %s (Ctrl+C again stops at "
                    "once, without a checkpoint)", self.path)
        on_sigterm = signal.getsignal(signal.SIGTERM)
        if callable(on_sigterm):  # Lightning's handler: marks the stop, tells the ranks
            on_sigterm(signal.SIGTERM, frame)
        else:
            raise KeyboardInterrupt

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return  # a failure: the last epoch's checkpoint stays the one to resume from
        self.signal = self.signal or signal.SIGTERM
        trainer.save_checkpoint(self.path)  # collective: every rank gets here
        if trainer.is_global_zero:
            log.warning("stopped by %s at epoch %d, step %d: saved %s; rerun with "
                        "hydra.run.dir=%s to resume", signal.Signals(self.signal).name,
                        trainer.current_epoch, trainer.global_step, self.path,
                        self.path.parent.parent)


def slurm_plugins(auto_requeue: bool, requeue_signal: str) -> list[Any]:
    """Lightning's SLURM environment with requeueing, when running under SLURM; else [].

    Args:
        auto_requeue: save an HPC checkpoint and ``scontrol requeue`` on the signal.
        requeue_signal: the signal's name (``SIGUSR1``; match ``sbatch --signal=USR1@90``).

    Raises:
        ConfigError: an unknown signal name.
    """
    try:
        sig = signal.Signals[requeue_signal.upper()]
    except KeyError:
        raise ConfigError(f"slurm.requeue_signal={requeue_signal!r} is not a signal name: use "
                          "e.g. SIGUSR1 (and sbatch --signal=USR1@90)") from None
    if not SLURMEnvironment.detect():
        return []
    return [SLURMEnvironment(auto_requeue=auto_requeue, requeue_signal=sig)]


def checkpoints_of(run: Path) -> list[Path]:
    """Every checkpoint a run saved, newest first.

    ``checkpoints/last.ckpt`` (end of an epoch, or a stop by SIGTERM / Ctrl+C), the best
    ones ``checkpoints/*.ckpt`` and Lightning's ``hpc_ckpt_<n>.ckpt`` in the run folder
    (SLURM requeue), by time written.
    """
    found = {p for p in [*(run / "checkpoints").glob("*.ckpt"), *run.glob("hpc_ckpt_*.ckpt")]
             if p.is_file()}
    return sorted(found, key=lambda p: p.stat().st_mtime_ns, reverse=True)


def newest_checkpoint(run: Path, *, trust: bool = False) -> Path | None:
    """The newest checkpoint of a run that loads (see :func:`checkpoints_of`), or None.

    A damaged one (empty, truncated) is skipped with a warning naming it; the next newest
    is taken. One that holds Python objects is refused outright: it was not written by
    this project, and resuming from an older one would hide that.

    Raises:
        InputError: the run has checkpoints but none loads (each one's problem named).
        UnsafeCheckpointError: a checkpoint holds Python objects (and ``trust`` is off).
    """
    from seg_at_scale.errors import InputError
    from seg_at_scale.models.checkpoint import UnsafeCheckpointError, load_checkpoint

    problems = []
    for path in checkpoints_of(run):
        try:
            load_checkpoint(path, trust=trust)
        except UnsafeCheckpointError:
            raise
        except InputError as exc:
            problems.append(str(exc))
            log.warning("skipping a checkpoint that cannot be resumed from: %s", exc)
            continue
        return path
    if problems:
        raise InputError(f"no checkpoint of the run in '{run}' can be resumed from: "
                         + " | ".join(problems))
    return None
