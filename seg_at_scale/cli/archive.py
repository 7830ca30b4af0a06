"""``seg-predict images=... output_dir=...``: the archive side of the prediction command.

:func:`archive_work` runs in the launching process, before any rank: it lists the scenes,
checks that no two of them write one path
(:func:`~seg_at_scale.prediction.archive.check_output_names`) and checks every one of them
(:func:`~seg_at_scale.prediction.archive.check_archive`).
:func:`predict_archive_job` runs on every rank with the model loaded once; rank 0 then
scores, writes the report and returns what the command prints.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from seg_at_scale.models.card import ModelCard
from seg_at_scale.models.trained import TrainedModel
from seg_at_scale.parallel.launch import rank_world
from seg_at_scale.prediction.archive import (
    ArchiveScene,
    SceneRecord,
    archive_scenes,
    check_archive,
    check_merge,
    predict_archive,
)
from seg_at_scale.prediction.lock import output_lock
from seg_at_scale.prediction.report import (
    check_report_files,
    merge_vectors,
    score,
    write_report,
)

if TYPE_CHECKING:
    from seg_at_scale.cli.predict import PredictJob

__all__ = ["ArchiveWork", "archive_work", "predict_archive_job"]


@dataclass(frozen=True)
class ArchiveWork:
    """The archive's scenes and those refused before any tile."""

    scenes: list[ArchiveScene]
    refused: list[SceneRecord]


def archive_work(job: PredictJob, card: ModelCard, source: str,
                 files: dict[str, Path], cuda: bool) -> ArchiveWork:
    """List and check every scene of ``job.images`` (see the module docstring)."""
    output_dir = Path(job.output_dir)  # type: ignore[arg-type]
    scenes = archive_scenes(job.images, output_dir,  # type: ignore[arg-type]
                            output_format=job.output_format,
                            masks=Path(job.masks) if job.masks else None, vector=job.vector,
                            vector_merge=job.vector_merge, options=job.options)
    refused = check_archive(scenes, job.options, card=card, source=source, model_files=files,
                            cuda=cuda, on_error=job.on_error)
    merged = next((s.vector.suffix for s in scenes if s.vector is not None), None)
    check_report_files(output_dir, mosaics=job.output_format == "tif", stac=job.options.stac,
                       merged=merged if job.vector_merge else None,
                       overwrite=job.options.overwrite)
    if job.vector_merge:
        check_merge(scenes, refused)
    return ArchiveWork(scenes, refused)


def predict_archive_job(job: PredictJob, trained: TrainedModel,
                        work: ArchiveWork) -> dict[str, Any]:
    """Every rank: predict the archive; rank 0: score, report, and what to print."""
    output_dir = Path(job.output_dir)  # type: ignore[arg-type]
    output_dir.mkdir(parents=True, exist_ok=True)
    rank = rank_world()[0]
    lock = output_lock(output_dir / "archive", what=f"output_dir '{output_dir}'") if rank == 0 \
        else contextlib.nullcontext()
    with lock:
        records = predict_archive(trained, work.scenes, job.options, on_error=job.on_error,
                                  checked=work.refused)
        if rank != 0:
            return {}
        scores = score(records, work.scenes, trained.num_classes, trained.ignore_index)
        merged = merge_vectors(records, work.scenes, output_dir) if job.vector_merge else None
        doc = write_report(records, output_dir, stac=job.options.stac, scores=scores)
    computed = sum(r.tiles_computed for r in records)
    return {"model": trained.source, "scenes": doc["scenes"],
            **{k: doc[k] for k in ("done", "reused", "skipped", "failed")},
            "tiles_computed": computed,
            "tiles_resumed": sum(r.tiles_resumed for r in records),
            **({"score": scores} if scores is not None else {}),
            "summary": str(output_dir / "summary.csv"), "mosaics": doc.get("mosaics", []),
            "items": doc.get("items"), "vectors": str(merged) if merged else None,
            "problems": {r.stem: r.reason for r in records
                         if r.status in ("skipped", "failed")}}
