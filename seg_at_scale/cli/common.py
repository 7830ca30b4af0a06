"""Pieces shared by the train and predict entry points (the only readers of DictConfigs)."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

from hydra.errors import InstantiationException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from seg_at_scale.config_check import check_local
from seg_at_scale.errors import ConfigError, SegAtScaleError, disk_full

__all__ = ["disk_full", "format_iou", "save_run_config", "reports_errors", "class_names_of",
           "USER_ERROR_EXIT", "long_lived",
           "LocalRunFolder", "tidy_refused_run",
           "run_began"]  # and RUN_CONFIG, read on first use (__getattr__)

log = logging.getLogger(__name__)

USER_ERROR_EXIT = 2  # exit status of a refused input or config (as argparse's usage errors)

F = TypeVar("F", bound=Callable[..., Any])


def __getattr__(name: str) -> str:
    """``RUN_CONFIG``, imported on first use.

    :mod:`seg_at_scale.models` imports torch, and every command's start (the override
    precheck, ``seg-predict``'s output lock) imports this module before torch is needed.
    """
    if name == "RUN_CONFIG":
        from seg_at_scale.models.trained import RUN_CONFIG

        return RUN_CONFIG
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_FROZEN: list[bool] = []  # long_lived() has frozen this process's objects


@contextlib.contextmanager
def long_lived() -> Iterator[None]:
    """Import the network stack as the long-lived objects it is: a command's start, once.

    Importing torch and Lightning makes about 900,000 objects that live as long as the
    process. Python's cyclic collector would scan them all in every full collection, during
    the import (seven of them) and during the run, and a DataLoader worker or a rank forked
    from the command would copy every page they lie on by writing the collector's marks.
    Inside this block the collector is off; at its end every object made so far is moved
    out of its reach (``gc.freeze``) and it is switched back on. A tiny ``seg-train`` ran
    1.47x faster on 2 cores (``experiments/bench_startup.py``), a demo epoch 1.09x,
    ``seg-predict`` of a 1024^2 scene 1.12x. The import's own cyclic garbage (about 14,000
    small objects) stays.

    Only the commands use it (never a library call, which would freeze a caller's objects),
    and only once per process: a sweep's later trials in the same process freeze nothing.
    A collector the user switched off stays off.
    """
    if _FROZEN:
        yield
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        _FROZEN.append(True)
        if enabled:
            gc.enable()


def _own_error(exc: BaseException) -> SegAtScaleError | None:
    """The project's error behind ``exc`` (Hydra's ``instantiate`` wraps what it raises)."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, SegAtScaleError):
        cause = cause.__cause__
    return cause


def file_system(exc: BaseException) -> SegAtScaleError | None:
    """An OS error about a named path (a file where a folder goes, no permission) as one line."""
    if isinstance(exc, OSError) and exc.filename:
        return SegAtScaleError(f"{exc.strerror or type(exc).__name__}: '{exc.filename}'; check "
                               "that path (SEG_DATA_DIR, data.root, output, run folders): a file "
                               "where a folder must be, a missing folder or no permission")
    return None


class _KeptOut:
    """A finder that refuses to import the named modules (see :func:`keep_out`)."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name in self.names:
            raise ModuleNotFoundError(
                f"this command does not use '{name}' and keeps it out of its process; a "
                "library that only uses it when installed goes on without it", name=name)


def keep_out(*names: str) -> None:
    """Refuse, from now on in this process, to import ``names`` (top-level modules).

    For a command that never uses a module a library imports whenever it is installed:
    timm imports wandb (``timm.utils.summary``), which takes 0.6-1 s and makes two
    temporary folders that only the interpreter's teardown removes, and
    :func:`exit_now` skips that teardown. Such a library's ``import`` is in a ``try``: it
    goes on without the module. Already imported, a module stays.
    """
    sys.meta_path.insert(0, _KeptOut(frozenset(n for n in names if n not in sys.modules)))


def exit_now(main: Callable[[], Any]) -> None:
    """Run a console entry point's ``main``, then end the process without the teardown.

    Every output is complete, renamed and closed when ``main`` returns (or exits with a
    status), so the interpreter's teardown only frees memory: torch's takes about half a
    second. Logs and the standard streams are flushed first. An unexpected exception is
    not caught: it prints its traceback and exits 1 as usual.
    """
    try:
        main()
        code = 0
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def reports_errors(prog: str) -> Callable[[F], F]:
    """Decorate an entry point: the project's own errors print as one line, exit status 2.

    A :class:`~seg_at_scale.errors.SegAtScaleError` already names the file or key, the value
    and the fix; the 30-60 lines of Hydra and library frames above it only bury it. A full
    disk (``ENOSPC``, ``EFBIG``, ``EDQUOT``, however deep) and an OS error about a named path
    (a file where a folder must be, no permission) are one line too.
    ``HYDRA_FULL_ERROR=1`` lets it through with its whole traceback. Put it *under*
    ``@hydra.main`` (Hydra unwraps ``__wrapped__`` to name the job)::

        @hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
        @reports_errors("seg-train")
        def main(cfg: DictConfig) -> None: ...

    Args:
        prog: the command's name, printed before the message.
    """
    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except (SegAtScaleError, InstantiationException, OSError) as exc:
                own = _own_error(exc) or disk_full(exc) or file_system(exc)
                if own is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                print(f"{prog}: error: {own}", file=sys.stderr, flush=True)
                raise SystemExit(USER_ERROR_EXIT) from None

        return cast(F, run)  # fn's signature (functools.wraps)

    return decorate


class LocalRunFolder(Callback):
    """Hydra callback: a run or sweep folder that is not local is refused before it is made.

    A URL or a GDAL virtual path is refused in one line
    (:func:`~seg_at_scale.config_check.check_local`, exit status 2): Hydra would make
    ``hydra.run.dir=s3://bucket/run`` here, as a local folder ``s3:/bucket/run``, and the
    run would be written into it. A run's folders that do not exist yet are noted for
    :func:`tidy_refused_run`.

    Hydra turns an exception of a callback into a warning, so the refusal ends the process
    itself (``SystemExit``), as :func:`reports_errors` does for the command's own errors.
    """

    def __init__(self, prog: str) -> None:
        self.prog = prog

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig

        # the folder may name ${hydra:...} values (seg-train's run_name): resolved as the job
        # will resolve it (Hydra sets this config as the job's next, and ${now:} is cached)
        hydra_config, flag = HydraConfig.instance(), config.hydra._get_node_flag("readonly")
        before = hydra_config.cfg
        try:
            hydra_config.set_config(config)
            folder = self._check(config, "hydra.run.dir")
        finally:
            hydra_config.cfg = before
            OmegaConf.set_readonly(config.hydra, flag)
        _MADE.clear()
        _NEW_LOG.clear()
        if folder is not None:
            path = Path(folder).absolute()
            _MADE.extend(f for f in (path, *path.parents) if not f.exists())
            log = path / f"{config.hydra.job.name}.log"  # Hydra's log of the job
            if not log.exists():
                _NEW_LOG.append(log)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _MADE.clear()  # a sweep's trials keep their folders (a run before it in this process)
        self._check(config, "hydra.sweep.dir")

    def _check(self, config: DictConfig, key: str) -> str | None:
        folder = OmegaConf.select(config, key, throw_on_resolution_failure=False)
        if folder is None:
            return None
        try:
            check_local(f"{key}='{folder}'", str(folder), output=True)
        except ConfigError as exc:
            print(f"{self.prog}: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(USER_ERROR_EXIT) from None
        return str(folder)


#: the folders Hydra makes for this run, deepest first (LocalRunFolder)
_MADE: list[Path] = []
#: Hydra's log of the job, where this command makes it
_NEW_LOG: list[Path] = []


@contextlib.contextmanager
def tidy_refused_run() -> Iterator[None]:
    """A run refused before it began leaves no folder behind.

    On a refusal (the project's own error) before the run began (its ``run_config.yaml``
    saved: :func:`run_began`),
    Hydra's log of the job is removed if this command made it, and then the folders Hydra
    made for this run (noted by :class:`LocalRunFolder`) if they are empty: a mistyped
    command does not leave an empty dated folder under ``runs/``, nor its log in a folder of
    the user's. A folder that existed before, or that holds anything else (a run's config,
    checkpoints), is left.
    """
    try:
        yield
    except BaseException as exc:
        if _own_error(exc) is not None:
            with contextlib.suppress(OSError):
                for log in _NEW_LOG:
                    log.unlink(missing_ok=True)
                for folder in _MADE:  # deepest first; rmdir leaves a folder with files
                    folder.rmdir()
        raise


def run_began() -> None:
    """The run was accepted: its log is kept whatever ends it (:func:`tidy_refused_run`)."""
    _NEW_LOG.clear()


def class_names_of(data: DictConfig) -> list[str]:
    """``data.class_names``, or ``class_0 .. class_{K-1}`` when it is null.

    Raises:
        ConfigError: a list whose length is not ``data.num_classes``.
    """
    k = int(data.num_classes)
    names = data.get("class_names")
    if names is None:
        return [f"class_{i}" for i in range(k)]
    names = [str(n) for n in names]
    if len(names) != k:
        raise ConfigError(f"data.class_names has {len(names)} names but data.num_classes={k}; "
                          "give one name per class, or data.class_names=null for class_0, "
                          "class_1, ...")
    return names


def format_iou(result: dict[str, Any], class_names: list[str]) -> str:
    """One line per class plus the mean, for the console."""
    lines = [f"  {name:<12s} IoU {v if v is not None else float('nan'):.4f}"
             for name, v in zip(class_names, result.get("iou", []))]
    lines.append(f"  {'mIoU':<12s}     {result.get('miou', float('nan')):.4f}")
    return "\n".join(lines)


def save_run_config(cfg: DictConfig, out_dir: Path, computed: dict[str, Any]) -> Path:
    """Write the resolved config with the computed values (halo, E, ...) into the run."""
    from seg_at_scale.models.trained import RUN_CONFIG

    doc = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(doc, dict)
    doc["computed"] = computed
    path = out_dir / RUN_CONFIG
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(doc)))
    run_began()  # the run's first file: its log is kept from now on
    return path
