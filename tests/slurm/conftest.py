"""The test Slurm cluster (one per test session, i.e. per pytest-xdist worker) and what its
jobs need: ``seg-train`` / ``seg-predict`` on the PATH running this checkout."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cluster import Cluster, unavailable
from slurm_helpers import EPOCHS, EXACT, REPO, finish, start_reference

COMMANDS = {"seg-train": "seg_at_scale.cli.train", "seg-predict": "seg_at_scale.cli.predict"}
# what pip writes for a console script: the entry point imported from its module (run as
# ``python -m`` instead, a submitit job would unpickle the task from ``__main__``)
CONSOLE_SCRIPT = """#!{python}
import sys
from {module} import main
if __name__ == "__main__":
    sys.argv[0] = "{name}"
    sys.exit(main())
"""


def _worker_index() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(worker[2:]) if worker[2:].isdigit() else 0


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Cluster]:
    """A started two-node cluster; stopped at the end of the session, nothing left running.

    Each xdist worker has its own (own folder, free ports, ``ClusterName`` and job ids a
    thousand apart, so Lightning's job-id-derived rendezvous ports never meet).
    """
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    k = _worker_index()
    root = Path(tempfile.mkdtemp(prefix=f"seg-slurm-{k}-", dir="/tmp"))  # short: socket paths
    cluster = Cluster.create(root, name=f"segtest{k}", first_job_id=1 + 1000 * k)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    left = cluster.stop()
    assert not left, f"still running after the cluster stopped (killed now): {left}"
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def _cluster_idle_first(request: pytest.FixtureRequest) -> None:
    """Before each test on the cluster: no job left and both nodes idle. A node the test
    before left drained or down (on a loaded machine: a step Slurm could not kill within
    ``UnkillableStepTimeout``, a node daemon that missed ``SlurmdTimeout``) is resumed with
    a warning that gives the controller's reason, instead of leaving every later two-node
    job pending."""
    if "slurm_cluster" in request.fixturenames:
        problem = request.getfixturevalue("slurm_cluster").settle()
        if problem:
            warnings.warn(f"before {request.node.name}: {problem}", stacklevel=1)


@pytest.fixture(scope="session")
def console_scripts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``bin/`` whose ``seg-train`` / ``seg-predict`` run this checkout with this Python
    (the README's scripts call the installed console scripts)."""
    folder = tmp_path_factory.mktemp("bin")
    for name, module in COMMANDS.items():
        script = folder / name
        script.write_text(CONSOLE_SCRIPT.format(python=sys.executable, module=module, name=name))
        script.chmod(0o755)
    return folder


def job_env(tmp: Path, console_scripts: Path) -> dict[str, str]:
    """The whole environment of a test's jobs (sbatch passes it on: ``--export=ALL``).

    ``MASTER_ADDR``: the test nodes ``n1`` / ``n2`` are names of Slurm's only; on a real
    cluster node names resolve and Lightning takes the first one's.
    """
    return {"PATH": f"{console_scripts}:/usr/bin:/bin", "PYTHONPATH": str(REPO),
            "SEG_DATA_DIR": str(tmp / "data"), "WANDB_MODE": "offline", "CI": "true",
            "HOME": os.environ.get("HOME", "/root"), "MASTER_ADDR": "127.0.0.1"}


@pytest.fixture()
def jobs_env(tmp_path: Path, console_scripts: Path) -> dict[str, str]:
    return job_env(tmp_path, console_scripts)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory,
              console_scripts: Path) -> Iterator[Callable[[], Path]]:
    """The one-process run (outside Slurm) of the exact problem the training and requeue
    tests train on Slurm (``EXACT``, ``EPOCHS`` epochs): started when first asked for, in
    the background; calling the fixture's value waits for it and gives its run folder."""
    tmp = tmp_path_factory.mktemp("one")
    proc = start_reference(tmp, "one", job_env(tmp, console_scripts), *EXACT,
                           f"trainer.max_epochs={EPOCHS}")

    def done() -> Path:
        finish(proc, tmp / "one.log")
        return tmp / "one"

    yield done
    if proc.poll() is None:
        proc.kill()
        proc.wait()
