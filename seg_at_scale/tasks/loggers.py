"""The experiment loggers of ``conf/logger``, as Lightning makes them, less its noise.

:class:`WandbLogger` is Lightning's: Lightning hands ``wandb.init`` an ``anonymous``
setting (``None`` unless asked for) that wandb no longer reads and warns about on every
run (``wandb: WARNING The anonymous setting has no effect ...``), the first line a user
of the default command saw that was neither theirs nor the project's. Left out when
unset; given (``logger.wandb.anonymous=true``), it is passed on as before.

:func:`own_tracker_run`: the wandb run a training run starts ends with it. Lightning leaves
it open for the interpreter's exit, so the next run of a multirun sweep in the same process
(Hydra's basic launcher) found it in progress and logged into it: every trial's curves and
scores in the first trial's wandb run. Ended at the exit instead, its closing lines came
from wandb's service with their colour codes, raw in a Slurm job's output or a ``| tee``.

A resumed run (the same command again, a Slurm requeue) continues its wandb run: the run
folder keeps the id of the run it began (``wandb/run_id``), and a rerun into the folder
passes it to wandb (Lightning asks wandb to resume an id it is given). Online, the curves go
on in the same W&B run; offline, each start writes ``wandb/offline-run-<time>-<id>``, which
``wandb sync`` uploads into that one run, in order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import string
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pytorch_lightning.loggers import WandbLogger as _LightningWandbLogger
from pytorch_lightning.utilities import rank_zero_only

__all__ = ["WandbLogger", "own_tracker_run", "recorded_run_id", "RUN_ID_FILE"]

log = logging.getLogger("seg_at_scale.train")

RUN_ID_FILE = Path("wandb") / "run_id"  # in the run folder (the logger's save_dir)
_ID_CHARS = string.ascii_lowercase + string.digits  # as wandb's own ids


class WandbLogger(_LightningWandbLogger):
    """Lightning's ``WandbLogger``: the wandb run of its folder, no unset ``anonymous``.

    The run folder's wandb run is continued (see the module docstring); an ``id`` (or
    ``version``) given is used as it is and not recorded.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        save_dir = kwargs.get("save_dir")
        record = None  # the id to record in the folder once the run begins
        if save_dir is not None and kwargs.get("id") is None and kwargs.get("version") is None:
            kwargs["id"] = recorded_run_id(Path(save_dir))
            if kwargs["id"] is None:
                kwargs["id"] = "".join(secrets.choice(_ID_CHARS) for _ in range(8))
                record = Path(save_dir) / RUN_ID_FILE
        super().__init__(*args, **kwargs)
        self._record = record
        init = getattr(self, "_wandb_init", None)  # the arguments of wandb.init
        if isinstance(init, dict) and init.get("anonymous") is None:
            init.pop("anonymous", None)

    @property
    def experiment(self) -> Any:
        """Lightning's wandb run; its id is recorded in the folder when it begins.

        Recorded then, not when the logger is made: a command Lightning refuses after that
        leaves its folder as it found it, for the corrected command to use. Only global
        rank 0 begins a run (the others get Lightning's stand-in) and records it.
        """
        run = super().experiment
        run_id = getattr(run, "id", None)  # a run in progress before (a notebook's): its own
        if self._record is not None and isinstance(run_id, str) \
                and getattr(rank_zero_only, "rank", 0) == 0:
            self._record.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._record.with_name(f".{self._record.name}.{os.getpid()}.tmp")
            tmp.write_text(f"{run_id}\n")
            os.replace(tmp, self._record)  # whole or absent
            self._record = None
        return run


def recorded_run_id(folder: Path) -> str | None:
    """The wandb run id recorded in a training run's folder, or None (a new run)."""
    try:
        return (folder / RUN_ID_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None


def _wandb_run() -> Any:
    """The wandb run in progress in this process, or None (wandb not even imported)."""
    wandb = sys.modules.get("wandb")
    return getattr(wandb, "run", None) if wandb is not None else None


@contextlib.contextmanager
def own_tracker_run() -> Iterator[None]:
    """End, when the block ends, the wandb run begun inside it (by the run's logger).

    The run is finished with the block's outcome: exit code 0, the status a ``SystemExit``
    carries (a stopped run's 143), or 1 for an error. A run in progress before the block (a
    notebook's own) is left as it is.
    """
    before = _wandb_run()
    code = 1
    try:
        yield
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        raise
    finally:
        run = _wandb_run()
        if run is not None and run is not before:
            try:
                run.finish(exit_code=code)
            except Exception as exc:  # the training's outcome stands; its record is wandb's
                log.warning("wandb could not finish its run (%s): %s", type(exc).__name__, exc)
