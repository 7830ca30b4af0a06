"""Hyperparameter sweeps: optuna search with a stored study, parallel trials, sweep reports.

* ``seg-train -m hparams_search=optuna``: TPE over the config (:mod:`.optuna_sweep`,
  :mod:`.space`, :mod:`.study`), each trial bounded and pruned (:mod:`.pruning`);
* ``hydra/launcher=local_parallel``: k trials at once, cores split (:mod:`.launcher`);
* ``seg-sweep-report <folder>``: CSV + PNG + best command of any sweep (:mod:`.report`),
  from what every run records (:mod:`.record`).

The Hydra plugins themselves are thin classes in ``hydra_plugins/seg_at_scale_sweeps``.
Nothing here imports optuna or torch at package import.
"""
