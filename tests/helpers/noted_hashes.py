"""``seg-predict`` noting, in the file ``$SEG_TEST_HASHED``, each process that hashes the
input for its fingerprint (``tests/prediction/test_prediction_ranks.py``): the forked ranks
inherit the note."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    from seg_at_scale.prediction import plan

    real = plan.file_blake3

    def noted(path):
        with open(os.environ["SEG_TEST_HASHED"], "a") as f:
            f.write(f"{os.getpid()}\n")
        return real(path)

    plan.file_blake3 = noted
    from seg_at_scale.cli.predict import main

    sys.argv = ["seg-predict", *sys.argv[1:]]
    main()
