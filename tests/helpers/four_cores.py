"""``seg-predict`` on a machine that reports 4 cores (``tests/prediction/test_prediction_ranks.py``
and its forked ranks): each of 2 ranks then runs 2 OpenMP threads, which hang in a fork if
the launching process had run OpenMP before forking."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.sched_getaffinity = lambda pid: {0, 1, 2, 3}
    from seg_at_scale.cli.predict import main

    sys.argv = ["seg-predict", *sys.argv[1:]]
    main()
