"""seg_at_scale's Hydra plugins: the optuna sweeper and the local parallel launcher.

Hydra finds plugins only inside the ``hydra_plugins`` namespace package and imports every
module here at start-up, so these modules stay thin (no optuna, no torch at import); the
logic lives in :mod:`seg_at_scale.sweeps`.
"""
