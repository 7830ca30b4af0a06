"""OmegaConf resolvers the training configs use; registered when ``seg_at_scale.cli`` is imported.

``${seg.class_weights:<root>,<num_classes>,<ignore_index>,<power>}``: the class weights of
the training masks under ``<root>/train`` raised to ``power``
(:func:`seg_at_scale.tasks.class_weights.scene_class_weights`), or null when the power is
null or 0. ``data.class_weights`` of the synthetic and TIFF datasets is this expression over
``data.class_weight_power``; the saved ``run_config.yaml`` holds the weights it gave.

``${seg.gradient_reduction:<tiling mode>}``: ``sum`` for grid tiling, ``mean`` for random
tiles (:func:`seg_at_scale.tasks.segmentation.gradient_reduction_for`); the tasks'
``gradient_reduction``.

``${seg.job_folder:<job number>,<override dirname>}``: a sweep job's folder name, one
level below the sweep folder: ``<n>_<overrides>`` with a path's ``/`` written ``_`` (a
value like ``data.root=/scenes/a`` made a tree of folders, in which the sweep report found
no job), cut at :data:`JOB_FOLDER_CHARS` characters (a file name holds 255 bytes; the
number keeps it unique).

``${seg.tiles:<tiling.q>}``: tiles per side as a word for run names: ``2`` for ``2``,
``1x4`` for ``[1, 4]`` (rows x cols; the list itself would put brackets and a space in
the run's folder name).

``${seg.tracker_name:<run_name>}`` and ``${seg.tracker_group:}``: an experiment tracker's
run name and group (``conf/logger/wandb.yaml``). A single run: its ``run_name``, no group.
A job of a multirun sweep: ``<run_name>/<job folder>`` in the group of its sweep folder's
name, so the trials of one sweep are told apart and shown together (every trial was named
``run_name`` alone).
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import OmegaConf

__all__ = ["register_resolvers", "job_folder", "tiles_word", "tracker_group", "tracker_name",
           "JOB_FOLDER_CHARS"]

JOB_FOLDER_CHARS = 120


def _class_weights(root: str, num_classes: int, ignore_index: int,
                   power: Any = None) -> list[float] | None:
    from seg_at_scale.tasks.class_weights import scene_class_weights

    return scene_class_weights(root, int(num_classes), int(ignore_index), power)


def _gradient_reduction(tiling_mode: str) -> str:
    from seg_at_scale.tasks.segmentation import gradient_reduction_for

    return gradient_reduction_for(str(tiling_mode))


def job_folder(num: Any, overrides: Any = "") -> str:
    """``<num>_<overrides>``, one folder: no separator, at most ``JOB_FOLDER_CHARS``."""
    name = f"{num}_{overrides}" if str(overrides) else str(num)
    for sep in {"/", "\\", os.sep}:
        name = name.replace(sep, "_")
    return name[:JOB_FOLDER_CHARS]


def tiles_word(q: Any) -> str:
    """``tiling.q`` in a run name: ``2``, ``1x4`` for a ``[rows, cols]`` pair."""
    if isinstance(q, str | int) or q is None:
        return str(q)
    return "x".join(str(v) for v in q)


def _sweep_job() -> tuple[str, str] | None:
    """``(sweep folder's name, job folder)`` inside a multirun's job, else None."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    if hydra.mode != RunMode.MULTIRUN:
        return None
    return (os.path.basename(os.path.normpath(str(hydra.sweep.dir))),
            job_folder(hydra.job.num, hydra.job.override_dirname))


def tracker_name(run_name: Any) -> str:
    """A tracker's run name: ``run_name``, and in a sweep ``<run_name>/<job folder>``."""
    job = _sweep_job()
    return f"{run_name}/{job[1]}" if job else str(run_name)


def tracker_group() -> str | None:
    """A tracker's group: a sweep's folder name; none for a single run."""
    job = _sweep_job()
    return job[0] if job else None


def register_resolvers() -> None:
    """Register the project's resolvers (idempotent)."""
    if not OmegaConf.has_resolver("seg.class_weights"):
        # cached: the masks are read once per config, not at every access
        OmegaConf.register_new_resolver("seg.class_weights", _class_weights, use_cache=True)
    if not OmegaConf.has_resolver("seg.gradient_reduction"):
        OmegaConf.register_new_resolver("seg.gradient_reduction", _gradient_reduction)
    if not OmegaConf.has_resolver("seg.job_folder"):
        OmegaConf.register_new_resolver("seg.job_folder", job_folder)
    if not OmegaConf.has_resolver("seg.tiles"):
        OmegaConf.register_new_resolver("seg.tiles", tiles_word)
    if not OmegaConf.has_resolver("seg.tracker_name"):
        OmegaConf.register_new_resolver("seg.tracker_name", tracker_name)
    if not OmegaConf.has_resolver("seg.tracker_group"):
        OmegaConf.register_new_resolver("seg.tracker_group", tracker_group)
