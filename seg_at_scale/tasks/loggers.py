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
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

from pytorch_lightning.loggers import WandbLogger as _LightningWandbLogger

__all__ = ["WandbLogger", "own_tracker_run"]

log = logging.getLogger("seg_at_scale.train")


class WandbLogger(_LightningWandbLogger):
    """Lightning's ``WandbLogger``, without the unset ``anonymous`` setting."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        init = getattr(self, "_wandb_init", None)  # the arguments of wandb.init
        if isinstance(init, dict) and init.get("anonymous") is None:
            init.pop("anonymous", None)


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
