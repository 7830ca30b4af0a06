"""Staged prediction: a network run stage by stage, each stage tiled over whole feature maps.

* :mod:`.stages` - the stages, their halos, the plan under a memory budget, and the run
  (in memory with :func:`predict_staged`, or window by window into files with
  :func:`staged_maps`);
* :mod:`.core_only` - a block computing only a tile's core, where its layers allow it;
* :mod:`.peak_memory` - the most tensor memory a stage's forward holds, counted per
  operation (what the plan budgets);
* :mod:`.heap_return` - heap memory freed by a stage's tiles given back to the system.

A network offers its stages through the :class:`~seg_at_scale.models.contract.Staged`
capability (smp networks: :mod:`seg_at_scale.models.smp_stage_split`); ``seg-predict
staged=true`` runs them into the usual store (:mod:`seg_at_scale.prediction.staged_raster`).
"""

from seg_at_scale.tiling.staged.stages import (
    Chain,
    Stage,
    StagePlan,
    plan_stages,
    predict_staged,
    read_map,
    stage_halo,
    staged_maps,
    widest_tap,
)

__all__ = ["Chain", "Stage", "StagePlan", "plan_stages", "predict_staged", "read_map",
           "stage_halo", "staged_maps", "widest_tap"]
