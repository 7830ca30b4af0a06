"""Start or stop the two-node test Slurm cluster (the one the tests use) for a person to try.

    make slurm-up            # = python tools/slurm_cluster.py up .slurm
    export SLURM_CONF=$PWD/.slurm/slurm.conf
    sinfo; sbatch -N2 examples/slurm/train.sbatch ...
    make slurm-down          # = python tools/slurm_cluster.py down .slurm

Needs root and Debian's slurmctld, slurmd, slurm-client and munge (see
``tests/slurm/cluster.py``). The daemons run until ``down``, which stops them by the pids
``up`` recorded and ends any job process still carrying the cluster's mark.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "slurm"))
from cluster import Cluster, unavailable  # noqa: E402


def up(root: Path) -> int:
    """Start a cluster in ``root``; print how to reach it."""
    reason = unavailable()
    if reason:
        print(f"slurm-up: {reason}", file=sys.stderr)
        return 1
    if (root / "run" / "pids.json").exists():
        print(f"slurm-up: a cluster is already running in {root} (make slurm-down first)",
              file=sys.stderr)
        return 1
    cluster = Cluster.create(root.resolve())
    try:
        cluster.start(detach=True)
    except RuntimeError as exc:
        cluster.stop()
        print(f"slurm-up: {exc}", file=sys.stderr)
        return 1
    print(cluster.client("sinfo").stdout.rstrip())
    print(f"export SLURM_CONF={cluster.conf}")
    return 0


def down(root: Path) -> int:
    """Stop the cluster whose pids ``up`` recorded in ``root``."""
    pids = root / "run" / "pids.json"
    if not pids.exists():
        print(f"slurm-down: no cluster running in {root}", file=sys.stderr)
        return 0
    cluster = Cluster(root.resolve(), pids=json.loads(pids.read_text()))
    left = cluster.stop()
    print(f"slurm-down: stopped {root}" + (f"; killed leftovers {left}" if left else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``up`` / ``down`` a test cluster in a folder (default ``.slurm``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("up", "down"))
    parser.add_argument("root", nargs="?", default=".slurm", type=Path)
    args = parser.parse_args(argv)
    return up(args.root) if args.action == "up" else down(args.root)


if __name__ == "__main__":
    raise SystemExit(main())
