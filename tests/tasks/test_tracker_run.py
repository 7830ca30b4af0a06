"""A training run's wandb run ends with it (``own_tracker_run``), with its outcome."""

from __future__ import annotations

import contextlib
import logging
import sys
import types

import pytest

from seg_at_scale.tasks.loggers import own_tracker_run


class FakeRun:
    """What ``own_tracker_run`` uses of a wandb run: ``finish(exit_code=...)``."""

    def __init__(self, fails: bool = False) -> None:
        self.codes: list[int] = []
        self.fails = fails

    def finish(self, exit_code: int = 0) -> None:
        self.codes.append(exit_code)
        if self.fails:
            raise ConnectionError("the server did not answer")


@pytest.fixture()
def wandb(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    module = types.SimpleNamespace(run=None)
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_the_run_begun_inside_ends_with_the_blocks_outcome(wandb):
    runs = []
    for outcome, code in ((None, 0), (SystemExit(143), 143), (RuntimeError("x"), 1)):
        wandb.run = None
        with pytest.raises(type(outcome)) if outcome else contextlib.nullcontext():
            with own_tracker_run():
                wandb.run = FakeRun()  # the logger's wandb.init
                runs.append(wandb.run)
                if outcome:
                    raise outcome
        assert runs[-1].codes == [code]


def test_a_run_in_progress_before_is_left_and_a_failed_finish_does_not_fail_the_run(
        wandb, caplog):
    wandb.run = before = FakeRun()  # a notebook's own run
    with own_tracker_run():
        pass
    assert before.codes == []
    wandb.run = None
    with caplog.at_level(logging.WARNING, "seg_at_scale.train"), own_tracker_run():
        wandb.run = failing = FakeRun(fails=True)
    assert failing.codes == [0]
    assert "wandb could not finish its run (ConnectionError): the server did not" in caplog.text


def test_no_wandb_imported_is_nothing_to_end(monkeypatch):
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    with own_tracker_run():
        assert "wandb" not in sys.modules



def test_a_run_folder_records_the_wandb_run_it_began_and_a_rerun_takes_its_id(
        tmp_path, monkeypatch):
    """The id of the wandb run a run folder began is recorded there, and a logger made again
    for the folder (a resume, a requeue: tests/cli/test_train_faults.py runs one) takes it;
    another folder begins its own; a logger that never began a run records nothing (a
    command Lightning refuses leaves the folder as it was)."""
    import wandb as real_wandb

    from seg_at_scale.tasks.loggers import WandbLogger, recorded_run_id

    monkeypatch.setenv("WANDB_SILENT", "true")
    ids = []
    for folder in ("run", "other"):
        logger = WandbLogger(project="p", save_dir=str(tmp_path / folder), offline=True)
        with own_tracker_run():
            logger.log_metrics({"x": 1.0}, step=0)
        assert real_wandb.run is None  # finished
        ids.append(recorded_run_id(tmp_path / folder))
        (start,) = (tmp_path / folder / "wandb").glob("offline-run-*")
        assert start.name.endswith(f"-{ids[-1]}")
    assert None not in ids and ids[0] != ids[1]
    assert WandbLogger(project="p", save_dir=str(tmp_path / "run"), offline=True).version \
        == ids[0]
    unused = WandbLogger(project="p", save_dir=str(tmp_path / "refused"), offline=True)
    assert unused.version and not (tmp_path / "refused").exists()
