"""Stopping a training run without losing it: SIGTERM, Ctrl+C, SLURM's requeue.

* **SIGTERM** (what SLURM, Kubernetes and ``kill`` send before a kill): during training
  :class:`SaveOnStop` holds it until the current image's last tile (grid mode: the
  gradient summed so far is in memory only; random tiles: the batch), where all ranks
  decide together and Lightning's handler marks the stop; its loops raise
  ``SIGTERMException`` after that batch;
  :class:`SaveOnStop` then writes ``checkpoints/last.ckpt``, which a rerun into the run
  folder resumes from (``ckpt_path=auto``) exactly: the resumed epoch leaves out the
  batches done (:class:`~seg_at_scale.data.samplers.ResumableSampler`).
* **SIGINT** (Ctrl+C): the first one is turned into the same orderly stop (Lightning would
  otherwise raise ``KeyboardInterrupt`` wherever the program is, e.g. inside an optimiser
  step, and save nothing); a second one interrupts at once.
* **SLURM**: :func:`slurm_plugins` gives Lightning's ``SLURMEnvironment`` with
  ``auto_requeue``: on the requeue signal (``sbatch --signal=USR1@90``), held like SIGTERM
  to the image's end, Lightning saves ``hpc_ckpt_<n>.ckpt`` in the run folder and runs
  ``scontrol requeue``; Slurm then stops the job (SIGTERM: ``last.ckpt``) and the requeued
  job resumes from the newest checkpoint.
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
import torch
import torch.distributed as dist
from lightning_fabric.plugins.environments import SLURMEnvironment
from pytorch_lightning.utilities.exceptions import SIGTERMException

from seg_at_scale.errors import ConfigError

__all__ = ["SaveOnStop", "slurm_plugins", "newest_checkpoint", "SIGTERMException"]

log = logging.getLogger(__name__)


class SaveOnStop(pl.Callback):
    """Save ``<dirpath>/last.ckpt`` after every epoch and when SIGTERM or Ctrl+C stops.

    Lightning's ``ModelCheckpoint(save_last=True)`` writes ``last.ckpt`` only in the epochs
    its monitored metric improves (Lightning >= 2.5): without the save here a resume, or
    ``seg-predict ckpt=last``, would go back to the best epoch.

    Args:
        dirpath: the run's checkpoint folder.
        requeue_signal: Slurm's requeue signal when Lightning auto-requeues (held like
            SIGTERM to an image's end, where Lightning's handler saves ``hpc_ckpt_<n>.ckpt``
            and requeues), or None.

    Attributes:
        signal: the signal that stopped the run (``signal.SIGTERM`` / ``SIGINT``), or None.
        path: where the checkpoint goes.
    """

    def __init__(self, dirpath: str | os.PathLike[str],
                 requeue_signal: int | None = None) -> None:
        self.path = Path(dirpath) / "last.ckpt"
        self.signal: int | None = None
        self._previous: Any = None
        # SIGTERM and Slurm's requeue signal: Lightning's handlers, called at an image's end
        self._signals = [int(signal.SIGTERM)] + ([int(requeue_signal)] if requeue_signal else [])
        self._lightning: dict[int, Any] = {}
        self._held: set[int] = set()  # signals not acted on yet
        self._requeue = False  # the ranks agreed to requeue, before the next batch

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Put :meth:`_hold` in front of Lightning's handlers (it restores its own at the end)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self._signals:
            handler = signal.getsignal(sig)
            if callable(handler):
                self._lightning[sig] = handler
                signal.signal(sig, self._hold)

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM or the requeue signal during training: held until the image's last tile.

        Until the image's optimiser step its gradient summed so far is in memory only: a
        stop or an HPC checkpoint there would lose it, and the resumed run could not take
        the same step. The ranks act together at the image's end (:meth:`on_train_batch_end`):
        Lightning's handlers run collectives (a broadcast, the checkpoint's barrier), which
        inside a signal handler met the other ranks anywhere (a Slurm job's ranks are each
        signalled) and hung or broke the job.
        """
        self._held.add(signum)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        """At an image's end, on every rank: any rank's held signals, acted on.

        SIGTERM: the stop after this batch. The requeue signal: before the next batch.
        """
        if not self._lightning or not _image_ends(batch):
            return
        flags = [int(sig in self._held) for sig in self._signals]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            held = torch.tensor(flags, device=trainer.strategy.root_device)
            dist.all_reduce(held, op=dist.ReduceOp.MAX)  # every rank, at the same slot
            flags = [int(f) for f in held.tolist()]
        self._held.clear()
        if len(flags) > 1 and flags[1]:
            # not here: Lightning counts this batch done only after this hook, and the
            # checkpoint would have the resumed run take this image's step twice
            self._requeue = True
        if flags[0]:
            self._lightning[signal.SIGTERM](signal.SIGTERM, None)  # Lightning marks the stop

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        self._requeue_now()

    def _requeue_now(self) -> None:
        """Lightning's requeue handler, on every rank at once, between batches.

        It saves ``hpc_ckpt_<n>.ckpt`` (collective) and, on rank 0, runs ``scontrol
        requeue``; the ranks agreed on it at the image's end.
        """
        if self._requeue:
            self._requeue = False
            sig = self._signals[1]
            self._lightning[sig](sig, None)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # collective: every rank gets here. weights_only=False is the full training state
        # (optimizer, loops, callbacks) for a resume; it is still plain data that loads
        # with torch.load(weights_only=True). Said here, Lightning logs nothing about it
        trainer.save_checkpoint(self.path, weights_only=False)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        """First Ctrl+C: stop like SIGTERM (at the image's end); the second: at once."""
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
        self._requeue_now()  # a requeue agreed with the stop: still requeue the job
        trainer.save_checkpoint(self.path, weights_only=False)  # collective, as above
        if trainer.is_global_zero:
            log.warning("stopped by %s at epoch %d, step %d: saved %s; rerun with "
                        "hydra.run.dir=%s to resume", signal.Signals(self.signal).name,
                        trainer.current_epoch, trainer.global_step, self.path,
                        self.path.parent.parent)


def _image_ends(batch: Any) -> bool:
    """The batch is an image's last slot (grid mode), or a batch of its own (random tiles)."""
    return not (isinstance(batch, dict) and "last" in batch) or bool(batch["last"].all())


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
    """Every checkpoint a run saved, the furthest trained first.

    ``checkpoints/last.ckpt`` (end of every epoch, or a stop by SIGTERM / Ctrl+C) and
    Lightning's ``hpc_ckpt_<n>.ckpt`` in the run folder (SLURM requeue), newest first; then
    the best ones ``checkpoints/*.ckpt``, which are never further than ``last.ckpt``, newest
    first. By time written alone, a copied run (``cp -r``: new mtimes in any order) resumed
    from an older best checkpoint and trained its epochs again over ``last.ckpt``.
    """
    found = {p for p in [*(run / "checkpoints").glob("*.ckpt"), *run.glob("hpc_ckpt_*.ckpt")]
             if p.is_file()}
    return sorted(found, key=lambda p: (p.name == "last.ckpt" or p.name.startswith("hpc_ckpt_"),
                                        p.stat().st_mtime_ns), reverse=True)


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
    from seg_at_scale.models.checkpoint import (
        TRAIN_CHOICE,
        UnsafeCheckpointError,
        load_checkpoint,
    )

    problems = []
    for path in checkpoints_of(run):
        try:
            load_checkpoint(path, trust=trust, choice=TRAIN_CHOICE)
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
