"""Run folders are append-only: a finished run's configs are never rewritten.

A training run folder holds ``run_config.yaml`` (the resolved config, with the values the
run computed for itself: normalisation statistics, a measured tile size, default class
names) and ``.hydra/`` (what Hydra composed). Rerunning into the folder resumes the run
from its last checkpoint, and that is only sound with the same config: a changed model
would fail to load the checkpoint, and rewriting the configs would leave a run that
``seg-predict`` can no longer load either. So :meth:`RunFolder.open` compares the new
config with the saved one *before anything is written* and refuses a difference, naming
the keys; only the keys in :data:`RESUME_KEYS` (how long to train, workers, logging,
prediction after fit) may change on a resume.

Keys a run fills in itself (``data.scale: auto``, ``tiling.tile_size: auto``, ...) go
through :meth:`RunFolder.fill`: the saved config keeps the computed value and records the
requested one under ``computed.filled``; a resumed run takes the saved value instead of
computing it again, so both runs train on the same numbers.

Hydra writes ``.hydra/*.yaml`` before the task starts, which would clobber a finished run's
files; ``train.yaml`` sets ``hydra.output_subdir: null`` and :meth:`RunFolder.save` writes
them here instead: ``.hydra/`` for a new run, ``.hydra/resume_<k>/`` for each resume.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

from filelock import FileLock, Timeout
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict
from pytorch_lightning.utilities import rank_zero_only

from seg_at_scale.cli.common import RUN_CONFIG, save_run_config
from seg_at_scale.config_check import resolved
from seg_at_scale.errors import ConfigError

__all__ = ["RunFolder", "RESUME_KEYS", "config_diff", "run_lock", "LOCK_NAME"]

log = logging.getLogger(__name__)

# Keys that may differ when a run resumes: they change how long or how visibly it trains,
# not what it learns from or what its checkpoints hold.
RESUME_KEYS = ("trainer.max_epochs", "trainer.max_steps", "trainer.max_time",
               "trainer.enable_progress_bar", "trainer.log_every_n_steps", "data.num_workers",
               "ckpt_path", "predict", "predict_after_fit", "logger", "slurm", "trust_run")
MAX_LISTED = 8  # differences named in the refusal
LOCK_NAME = ".seg_train.lock"  # held by the run's global rank 0 while it trains
_ABSENT = object()  # a key one of two configs lacks


def _flat(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, leaf value)`` pairs of a nested dict (lists are leaves)."""
    if isinstance(tree, dict) and tree:
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, tree


def _free(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUME_KEYS)


def config_diff(saved: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Keys whose values differ, ``(key, saved, new)``; :data:`RESUME_KEYS` left out.

    >>> config_diff({"a": {"b": 1}, "trainer": {"max_epochs": 1}},
    ...             {"a": {"b": 2}, "trainer": {"max_epochs": 5}})
    [('a.b', 1, 2)]
    """
    old, now = dict(_flat(saved)), dict(_flat(new))
    return [(k, old.get(k, _ABSENT), now.get(k, _ABSENT)) for k in sorted(old.keys() | now.keys())
            if not _free(k) and old.get(k, _ABSENT) != now.get(k, _ABSENT)]


def _saved_dir(saved: dict[str, Any]) -> str | None:
    """The folder a saved run was written in (recorded, or the trainer's root dir)."""
    recorded = (saved.get("computed") or {}).get("run_dir")
    return recorded or (saved.get("trainer") or {}).get("default_root_dir")


def _moved(saved: dict[str, Any], path: Path) -> dict[str, Any]:
    """A moved or copied run's saved config with its own old paths read as the new folder.

    A run's config holds its folder (checkpoint and log dirs, the trainer's root): copied
    elsewhere, those are its only differences, and they must not block the resume. Nothing
    is logged here: a refused rerun must not write into the run's ``train.log``.
    """
    old = _saved_dir(saved)
    new = str(path)
    if not old or old == new:
        return saved

    def swap(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        if isinstance(v, str) and (v == old or v.startswith(old + "/")):
            return new + v[len(old):]
        return v

    return swap(saved)


def _show(v: Any) -> str:
    return "(absent)" if v is _ABSENT else repr(v)


def _resolved(cfg: DictConfig, key: str) -> Any:
    """The value of ``key`` with interpolations resolved, as plain Python."""
    return resolved(OmegaConf.create({"v": OmegaConf.select(cfg, key)}))["v"]


def global_rank() -> int:
    """This process's global rank as Lightning sees it (``rank_zero_only.rank``).

    Lightning sets the attribute when it is imported; its annotations do not declare it.
    """
    rank: int = getattr(rank_zero_only, "rank", 0)
    return rank


@contextlib.contextmanager
def run_lock(path: Path) -> Iterator[None]:
    """Hold the run folder's lock while training; a second ``seg-train`` is refused at once.

    Only global rank 0 locks (the other DDP ranks, started by Lightning or by SLURM, run in
    the same folder on purpose). The lock is an ``flock`` (``filelock``): the kernel drops
    it when the holder dies, so a killed run never blocks its own resume.
    """
    if global_rank() != 0:
        yield
        return
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"hydra.run.dir='{path}': cannot create the run folder ({exc}); "
                          "choose a writable place") from None
    file = path / LOCK_NAME
    lock = FileLock(file, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise ConfigError(f"hydra.run.dir='{path}' is in use by another seg-train (its lock "
                          f"'{file}' is held); wait for it to finish, or start a new run "
                          "(leave out hydra.run.dir)") from None
    try:
        yield
    finally:
        file.unlink(missing_ok=True)  # while held: a waiter retries on a new file
        lock.release()
        if created and not any(path.iterdir()):  # a refused new run leaves no folder
            path.rmdir()


#: what a run folder holds before its run_config.yaml: the lock, the log this command opened
_BEFORE_CONFIG = frozenset({LOCK_NAME, "train.log", ".hydra"})


def _refuse_foreign(path: Path) -> None:
    """Refuse a new run in a folder that holds files of the user's (no ``run_config.yaml``).

    A run writes ``summary.json``, ``trial.json``, ``predictions/``, checkpoints and logs
    under their own names: into such a folder it replaced the user's files of those names
    without a word.
    """
    if not path.is_dir():
        return
    found = sorted(p.name for p in path.iterdir() if p.name not in _BEFORE_CONFIG)
    if found:
        shown = ", ".join(found[:MAX_LISTED]) + (", ..." if len(found) > MAX_LISTED else "")
        raise ConfigError(f"hydra.run.dir='{path}' holds files that are not a seg_at_scale run "
                          f"({shown}), which a new run could replace; choose a new or empty "
                          "folder (leave out hydra.run.dir for a new one)")


class RunFolder:
    """A training run's folder, new or resumed; see the module docstring.

    Attributes:
        path: the folder (Hydra's ``runtime.output_dir``).
        resuming: the folder already holds a run with this config.
        filled: ``{key: requested value}`` of the keys the run filled in itself.
    """

    def __init__(self, path: Path, saved: dict[str, Any] | None,
                 requested: DictConfig | None = None) -> None:
        self.path, self._saved, self._requested = path, saved, requested
        self.resuming = saved is not None
        self.filled: dict[str, Any] = dict((saved or {}).get("computed", {}).get("filled", {}))
        self._notes: list[str] = []  # logged by announce()

    @classmethod
    def detached(cls) -> RunFolder:
        """A run of no folder: :meth:`fill` sets values (for library callers and tests)."""
        return cls(Path.cwd(), None)

    @classmethod
    def open(cls, path: Path, cfg: DictConfig) -> RunFolder:
        """The run folder for ``cfg``; refuses a saved run whose config differs.

        On a resume the saved values of filled keys are set in ``cfg``.

        Raises:
            ConfigError: the folder holds a run with another config (nothing is written).
        """
        file = path / RUN_CONFIG
        requested = copy.deepcopy(cfg)  # as composed: what .hydra/config.yaml records
        if not file.exists():
            _refuse_foreign(path)
            return cls(path, None, requested)
        loaded = OmegaConf.to_container(OmegaConf.load(file))
        assert isinstance(loaded, dict)
        saved = cast(dict[str, Any], loaded)  # a config file: its keys are names
        was = _saved_dir(saved)
        saved = _moved(saved, path)
        run = cls(path, saved, requested)
        candidate = copy.deepcopy(cfg)
        diffs = run._apply_fills(candidate)
        now = resolved(candidate)
        diffs += config_diff({k: v for k, v in saved.items() if k != "computed"}, now)
        if diffs:
            raise run._refusal(diffs)
        run._apply_fills(cfg)
        if was and was != str(path):
            run._notes.append(f"the run was saved in {was} and is now in {path}: its own "
                              "paths follow it")
        run._notes.append(f"resuming the run in {path} (same config)")
        return run

    def announce(self) -> None:
        """Log what :meth:`open` found (a moved run, a resume), once the rerun is accepted.

        Not in :meth:`open`: its lines would go into the run's ``train.log`` before a
        refusal (another config, no checkpoint), and a refused rerun changes no file.
        Global rank 0 says it for the run: the DDP ranks Lightning starts open the folder
        rank 0 has written, a new run's too, and said "resuming the run" for it.
        """
        if global_rank() != 0:
            self._notes.clear()
            return
        for note in self._notes:
            log.info("%s", note)
        self._notes.clear()

    def _apply_fills(self, cfg: DictConfig) -> list[tuple[str, Any, Any]]:
        """Set the saved values of filled keys; differences in their requested values."""
        assert self._saved is not None
        diffs = []
        for key, requested in self.filled.items():
            asked = _resolved(cfg, key)
            if asked != requested:
                diffs.append((key, requested, asked))
            with open_dict(cfg):
                OmegaConf.update(cfg, key, OmegaConf.select(OmegaConf.create(self._saved), key),
                                 force_add=True)
        return diffs

    def _refusal(self, diffs: list[tuple[str, Any, Any]]) -> ConfigError:
        lines = [f"  {k}: {_show(a)} in the run, {_show(b)} now" for k, a, b in diffs[:MAX_LISTED]]
        more = f"\n  ... and {len(diffs) - MAX_LISTED} more" if len(diffs) > MAX_LISTED else ""
        return ConfigError(
            f"hydra.run.dir='{self.path}' holds a run with another config; resuming it would "
            f"train a different model on its checkpoint and rewrite its configs. Differences "
            f"(saved in {self.path / RUN_CONFIG}):\n" + "\n".join(lines) + more +
            "\nTo start a new run, leave out hydra.run.dir (a new dated folder) or give a new "
            "folder; to resume this one, use its config (only "
            f"{', '.join(RESUME_KEYS)} may change).")

    def fill(self, cfg: DictConfig, key: str, compute: Callable[[], Any]) -> Any:
        """Set ``key`` to a value the run works out itself, recording the requested one.

        On a resume whose saved run filled ``key``, the saved value (already set by
        :meth:`open`) is kept and ``compute`` is not called.
        """
        if self.resuming and key in self.filled:
            return OmegaConf.select(cfg, key)
        requested = _resolved(cfg, key)
        value = compute()
        if value != requested:
            self.filled[key] = requested
            with open_dict(cfg):
                OmegaConf.update(cfg, key, value, force_add=True)
        return value

    def save(self, cfg: DictConfig, computed: dict[str, Any]) -> None:
        """Write the run's configs: all of them for a new run, only a resume record else.

        Only global rank 0 writes (DDP ranks started by Lightning reopen the folder).
        """
        if global_rank() != 0:
            return
        hydra_dir = self.path / ".hydra"
        if self.resuming:
            k = 1 + len(list(hydra_dir.glob("resume_*")))
            hydra_dir = hydra_dir / f"resume_{k}"
        else:
            save_run_config(cfg, self.path, {**computed, "filled": self.filled,
                                             "run_dir": str(self.path)})
        self._save_hydra(self._requested if self._requested is not None else cfg, hydra_dir)

    @staticmethod
    def _save_hydra(cfg: DictConfig, folder: Path) -> None:
        """What Hydra writes into ``.hydra/`` (it is told not to: it would clobber a run)."""
        folder.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, folder / "config.yaml")
        if HydraConfig.initialized():
            hydra_cfg = HydraConfig.get()
            OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), folder / "hydra.yaml")
            OmegaConf.save(hydra_cfg.overrides.task, folder / "overrides.yaml")
