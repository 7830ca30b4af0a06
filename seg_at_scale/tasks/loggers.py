"""The experiment loggers of ``conf/logger``, as Lightning makes them, less its noise.

:class:`WandbLogger` is Lightning's: Lightning hands ``wandb.init`` an ``anonymous``
setting (``None`` unless asked for) that wandb no longer reads and warns about on every
run (``wandb: WARNING The anonymous setting has no effect ...``), the first line a user
of the default command saw that was neither theirs nor the project's. Left out when
unset; given (``logger.wandb.anonymous=true``), it is passed on as before.
"""

from __future__ import annotations

from typing import Any

from pytorch_lightning.loggers import WandbLogger as _LightningWandbLogger

__all__ = ["WandbLogger"]


class WandbLogger(_LightningWandbLogger):
    """Lightning's ``WandbLogger``, without the unset ``anonymous`` setting."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        init = getattr(self, "_wandb_init", None)  # the arguments of wandb.init
        if isinstance(init, dict) and init.get("anonymous") is None:
            init.pop("anonymous", None)
