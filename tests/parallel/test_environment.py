"""A process no launcher started never imports mpi4py: Lightning's MPI probe calls MPI_Init,
which aborted training on a machine with mpi4py but no MPI launcher (a lent GPU machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.cli import TINY, run_train
from lightning_fabric.plugins.environments import LightningEnvironment

from seg_at_scale.parallel.environment import MPI_LAUNCHER_VARIABLES, plain_environment

LAUNCHERS = {"mpi": {"OMPI_COMM_WORLD_SIZE": "2"},
             "torchrun": {"RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0",
                          "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x"},
             "slurm": {"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "n1"}}


@pytest.fixture
def no_launcher(monkeypatch):
    for name in (*MPI_LAUNCHER_VARIABLES, *(k for v in LAUNCHERS.values() for k in v),
                 "KUBERNETES_PORT", "LSB_JOBID", "LSF_VERSION", "JSM_NAMESPACE_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_without_a_launcher_lightning_gets_the_plain_environment(no_launcher):
    assert [type(e) for e in plain_environment()] == [LightningEnvironment]


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_under_a_launcher_lightning_chooses_as_it_always_does(no_launcher, launcher):
    for name, value in LAUNCHERS[launcher].items():
        no_launcher.setenv(name, value)
    assert plain_environment() == []


def fake_mpi4py(folder: Path) -> Path:
    """An installed ``mpi4py`` whose ``MPI`` aborts the process on import, as Open MPI's
    ``MPI_Init`` does where no launcher (nor ssh) is there to start it."""
    (folder / "mpi4py").mkdir(parents=True)
    (folder / "mpi4py" / "__init__.py").write_text("")
    (folder / "mpi4py" / "MPI.py").write_text(
        "import os\nimport sys\n\nsys.stderr.write('MPI_Init aborted: no launcher\\n')\n"
        "sys.stderr.flush()\nos.abort()\n")
    (folder / "mpi4py-4.0.0.dist-info").mkdir()
    (folder / "mpi4py-4.0.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: mpi4py\nVersion: 4.0.0\n")
    return folder


def test_training_runs_where_mpi4py_would_abort_it(no_launcher, tmp_path):
    """A fresh ``seg-train`` with such an ``mpi4py`` installed trains and checkpoints
    (Lightning's own detection imported ``mpi4py.MPI`` and the process died of SIGABRT)."""
    no_launcher.setenv("SEG_TEST_COLD", "1")  # a fresh interpreter: the path reaches it
    fake = fake_mpi4py(tmp_path / "site")
    out = run_train(tmp_path, "run", *TINY, "trainer.max_epochs=1",
                    "predict_after_fit=false", env={"PYTHONPATH": str(fake)})
    assert "MPI_Init aborted" not in out["log"]
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()


CASES = {"none": {},
         "torchrun": LAUNCHERS["torchrun"],
         "torchrun in slurm": {**LAUNCHERS["slurm"], **LAUNCHERS["torchrun"]},
         "slurm": LAUNCHERS["slurm"],
         "slurm interactive": {**LAUNCHERS["slurm"], "SLURM_JOB_NAME": "interactive"},
         "slurm bash": {**LAUNCHERS["slurm"], "SLURM_JOB_NAME": "bash"},
         "lsf": {"LSB_JOBID": "1", "LSB_DJOB_RANKFILE": "f", "JSM_NAMESPACE_LOCAL_RANK": "0",
                 "JSM_NAMESPACE_SIZE": "2"},
         "lsf partial": {"LSB_JOBID": "1"},
         "rank variables alone": {"RANK": "1", "GROUP_RANK": "0", "LOCAL_RANK": "1",
                                  "LOCAL_WORLD_SIZE": "2"}}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_launcher_rule_is_lightnings(no_launcher, case):
    """``seg-predict``'s question (did a launcher start the ranks?) and Lightning's plugins
    take one rule, read from the environment; it answers as Lightning's own detection does
    (its order: torchelastic, Slurm, LSF). seg-predict's own copy of the rule counted the
    rank variables without torchelastic's run id as a launch, where Lightning does not."""
    from lightning_fabric.plugins.environments import (
        LSFEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    from seg_at_scale.parallel.environment import launcher

    for name in CASES["rank variables alone"]:
        no_launcher.delenv(name, raising=False)
    for name, value in CASES[case].items():
        no_launcher.setenv(name, value)
    theirs = next((name for name, env in (("torchelastic", TorchElasticEnvironment),
                                          ("slurm", SLURMEnvironment), ("lsf", LSFEnvironment))
                   if env.detect()), None)
    assert launcher() == theirs
    assert (plain_environment() == []) == (theirs is not None)


def test_mpi_launchers_count_as_launchers(no_launcher):
    from seg_at_scale.parallel.environment import launcher

    for name in MPI_LAUNCHER_VARIABLES:
        no_launcher.setenv(name, "2")
        assert launcher() == "mpi"
        no_launcher.delenv(name)
    assert launcher() is None
