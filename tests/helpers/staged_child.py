"""A staged prediction of FPN in a process of its own, stopped by SIGTERM as ``seg-predict``
is (``tests/models/test_smp_staged_files.py``): ``python -m helpers.staged_child IMAGE OUT``."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from test_smp_files import DATA

    from helpers.smp import preset_model
    from seg_at_scale.cli.predict import Stopped, _terminate
    from seg_at_scale.prediction import PredictOptions, predict_raster

    signal.signal(signal.SIGTERM, _terminate)  # what seg-predict installs
    net = preset_model("fpn_test_resnet")
    try:
        predict_raster(net, sys.argv[1], sys.argv[2], PredictOptions(
            q=2, staged=True, stage_memory_mb=1, progress=False), normalizer=DATA)
    except Stopped:
        sys.exit(143)
