"""Shared fixtures: tiny synthetic scenes in the real on-disk format, the training CLI."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

# OpenMP threads that finish their share of an op spin-wait for the next one (libgomp's
# default, ~0.2 s): on a loaded machine (the workers, their subprocesses and DDP ranks on 2
# cores) that burns the CPU the others need: a tiny seg-train took 13 CPU-s, 6 when its
# threads wait passively (same threads, same results). Set before torch is imported here,
# and passed on to every subprocess, including those the tests give a bare environment.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# What the commands measure and keep (layouts.json, compile.json: the `own_cache` fixture
# below) goes to this run's cache, never to the user's ~/.cache; passed on in the same way
# (helpers.warm.PASSED_ON: one rule for subprocesses and warm processes).
from helpers.warm import passed_on  # noqa: E402  (the standard library only)

_popen_init = subprocess.Popen.__init__


def _passing_on(self, args, *more, env=None, **kwargs):  # noqa: ANN001, ANN002, ANN003
    if env is not None:
        env = passed_on(env)
    _popen_init(self, args, *more, env=env, **kwargs)


subprocess.Popen.__init__ = _passing_on  # type: ignore[method-assign]

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import seg_at_scale.cli  # noqa: F401, E402  (registers the configs' resolvers, as the commands do)
from seg_at_scale.io import example_geotags, write_raster  # noqa: E402

# pytest-xdist's workers share the cores as a job's ranks do: each worker's torch takes its
# share, so that two workers on 2 cores do not run 4 OpenMP threads against each other
# (the processes the tests start keep their own thread counts)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))


def run_temp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This run's temporary folder that its xdist workers share (the parent of theirs)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def own_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This run's cache of measurements, shared by its xdist workers, as a fresh machine's:
    empty at the start, never the user's."""
    root = run_temp(tmp_path_factory) / "seg_at_scale_cache"
    os.environ["SEG_AT_SCALE_CACHE"] = str(root)
    return root


@pytest.fixture()
def scene_files(tmp_path: Path):
    """Factory: write ``<name>_image.tif`` / ``<name>_mask.tif`` into a folder."""

    def make(folder: Path, name: str = "a", shape=(4, 203, 171), classes: int = 5,
             seed: int = 0, dtype=np.uint8, mask=None) -> tuple[Path, Path]:
        rng = np.random.default_rng(seed)
        folder.mkdir(parents=True, exist_ok=True)
        if np.issubdtype(dtype, np.floating):
            image = rng.random(shape).astype(dtype)
        else:
            image = rng.integers(0, 255, shape).astype(dtype)
        labels = rng.integers(0, classes, shape[1:]).astype(np.uint8) if mask is None else mask
        img = write_raster(folder / f"{name}_image.tif", image, tile=(64, 64),
                           geotags=example_geotags())
        msk = write_raster(folder / f"{name}_mask.tif", labels, tile=(64, 64))
        return img, msk

    return make


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread: on a shared 2-core machine OpenMP spinning makes small ops ~50x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Modules whose tests start real processes, clusters and sweeps (the suite's longest, ~2/3 of
# its time), then the longest of the others: collected first, so that `make test`
# (pytest-xdist, --dist loadscope: a module's tests share one worker and its module
# fixtures) ends on short modules on every worker instead of one worker finishing a long
# module alone. The Slurm modules, which mostly wait on
# the cluster, alternate with modules that use the CPU.
FIRST = ("slurm/test_slurm_requeue.py", "tasks/test_stops.py", "slurm/test_slurm_sweeps.py",
         "prediction/test_prediction.py", "slurm/test_slurm_training.py",
         "prediction/test_prediction_ranks.py", "slurm/test_slurm_prediction.py",
         "sweeps/test_sweeps.py", "cli/test_train_faults.py", "models/test_smp_cli.py",
         "cli/test_train_cli.py", "parallel/test_parallel_cli.py", "models/test_smp_predict.py",
         "models/test_trust.py", "models/test_segmodel.py", "prediction/test_archive.py",
         "cli/test_runs.py",
         # then the longest CPU-bound modules, longest first (30-70 s each)
         "models/test_smp_exact.py", "memory/test_tile_search.py", "cli/test_imports.py",
         "models/test_smp_staged.py", "prediction/test_rerun_outputs.py",
         "test_warm_processes.py", "cli/test_huge_pages.py", "cli/test_predict_start.py",
         "models/test_gscnn.py", "models/test_smp_staged_files.py", "test_gpu.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        name = item.path.relative_to(tests).as_posix() if item.path.is_relative_to(tests) else ""
        return FIRST.index(name) if name in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: the rest keep their order


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadscope`` (``make test``) with every Slurm module in one scope.

    A module's tests share one worker and its module fixtures, as with ``loadscope``; the
    Slurm modules run together on one worker, which starts one test cluster and one
    one-process reference (``tests/slurm``) and mostly waits on the cluster while the other
    workers use the CPU. (``--dist loadgroup`` would do it with ``xdist_group`` marks, but
    pytest-xdist 3.8 renames the items through an attribute pytest 9 no longer reads.)
    """
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SlurmTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "tests/slurm" if nodeid.startswith("tests/slurm/") else \
                super()._split_scope(nodeid)

    return SlurmTogether(config, log)


@pytest.fixture(scope="module")
def cli_case(tmp_path_factory):
    """A run folder (random 3-level same-padding U-Net) and a georeferenced scene for
    ``seg-predict`` in a subprocess: 263 x 377 (not a multiple of the alignment 8, nor of
    the tile cores), 17 x 24 = 408 tiles of 64, enough for a kill to land mid-run."""
    from helpers.prediction import CLI_SHAPE, make_image, make_model, make_run

    tmp = tmp_path_factory.mktemp("cli")
    run = make_run(tmp / "run", make_model("same", levels=3, width=8))
    return run, make_image(tmp / "scene.tif", *CLI_SHAPE)


@pytest.fixture(scope="module")
def cli_reference(cli_case, tmp_path_factory):
    """The uninterrupted ``seg-predict`` COG of ``cli_case`` at ``tile_size=64``: the fault
    tests compare their resumed outputs with it. Computed once in the run: the modules of
    every worker whose run folder and scene have the same bytes (the key) read the one
    output, which the first writes under a lock (seg-predict renames it when complete)."""
    from filelock import FileLock
    from helpers.prediction import seg_predict

    run, image = cli_case
    key = hashlib.sha256(b"".join(p.read_bytes() for p in (
        run / "run_config.yaml", run / "checkpoints" / "last.ckpt", image))).hexdigest()[:16]
    folder = run_temp(tmp_path_factory) / "cli_reference" / key
    folder.mkdir(parents=True, exist_ok=True)
    ref = folder / "mask.tif"
    with FileLock(folder.parent / f"{key}.lock"):
        if not ref.exists():
            seg_predict(run, image, ref, "tile_size=64")
    return ref
