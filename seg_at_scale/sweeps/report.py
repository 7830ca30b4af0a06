"""The report of a sweep folder: one CSV row per trial, a PNG, the best run as a command.

Run it::

    seg-sweep-report multirun/optuna_synthetic          # or python -m seg_at_scale.sweeps.report
    seg-sweep-report multirun/2026-01-01_10-00-00        # a grid sweep (-m tiling.q=1,2,4)

Every multirun also writes it when it ends (:class:`SweepReportCallback`, in ``train.yaml``).
It reads each job folder (``.hydra/overrides.yaml``, ``trial.json`` from the TrialRecord
callback, ``summary.json``) and, for an optuna sweep, the study in ``optuna.db`` (trial states,
values). It writes ``sweep_report.csv`` (job, status, objective, one column per searched key,
job seconds, fit seconds, epochs, best epoch, peak memory, torch threads, overrides, folder),
``sweep_report.png`` (objective by trial and by each parameter) and ``best_command.txt``.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml
from hydra.experimental.callback import Callback

from seg_at_scale.sweeps.study import INTERRUPTED, STUDY_FILE

__all__ = ["TrialRow", "SweepReport", "collect_trials", "write_report", "best_command",
           "format_table", "read_record", "RECORD_FILE", "SweepReportCallback",
           "report_unended_multiruns", "main"]

log = logging.getLogger("seg_at_scale.sweeps")

CSV_FILE, PNG_FILE, COMMAND_FILE = "sweep_report.csv", "sweep_report.png", "best_command.txt"
NOT_PARAMS = ("hparams_search=", "hydra.", "hydra/")  # overrides that are not a run's setting
RECORD_FILE = "trial.json"  # written by seg_at_scale.sweeps.record.TrialRecord


def read_record(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's ``trial.json``, or None when the run wrote none (yet)."""
    try:
        return json.loads((Path(run_dir) / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None


@dataclass
class TrialRow:
    """One job of a sweep.

    Attributes:
        job: Hydra's job number (= the optuna trial number).
        run: the job's folder.
        status: complete, pruned, failed, interrupted, running or incomplete (no summary).
        objective: the run's best monitored value (the study's value for complete trials).
        overrides: the job's Hydra overrides.
        record: the run's ``trial.json`` (empty when absent).
        seconds: job wall time, from its config file to its last output.
    """

    job: int
    run: Path
    status: str
    objective: float | None
    overrides: list[str]
    record: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None

    def value_of(self, key: str) -> str | None:
        """This job's override value of ``key`` (None when it did not set it)."""
        for o in self.overrides:
            k, _, v = o.partition("=")
            if k.lstrip("+~") == key:
                return v
        return None


@dataclass
class SweepReport:
    """Rows, the searched keys, the direction and the best complete row."""

    folder: Path
    rows: list[TrialRow]
    params: list[str]
    direction: str
    best: TrialRow | None


def _job_number(job_dir: Path) -> int:
    try:
        doc = yaml.safe_load((job_dir / ".hydra" / "hydra.yaml").read_text())
        return int(doc["hydra"]["job"]["num"])
    except (OSError, KeyError, TypeError, ValueError):
        digits = "".join(c for c in job_dir.name.split("_")[0] if c.isdigit())
        return int(digits) if digits else -1


def _study_trials(folder: Path, study_name: str | None) -> tuple[dict[int, Any], str | None]:
    """``{trial number: FrozenTrial}`` and the direction, from ``<folder>/optuna.db``."""
    db = folder / STUDY_FILE
    if not db.exists():
        return {}, None
    import optuna

    storage = optuna.storages.RDBStorage(f"sqlite:///{db.resolve()}")
    names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
    name = study_name or (names[0] if len(names) == 1 else None)
    if name not in names:
        raise ValueError(f"{db} holds studies {names}; name one with --study")
    study = optuna.load_study(study_name=name, storage=storage)
    return {t.number: t for t in study.get_trials(deepcopy=False)}, study.direction.name.lower()


def _seconds(job_dir: Path) -> float | None:
    start = job_dir / ".hydra" / "config.yaml"
    ends = [p.stat().st_mtime for p in (job_dir / "summary.json", job_dir / "trial.json")
            if p.exists()]
    return round(max(ends) - start.stat().st_mtime, 1) if ends and start.exists() else None


def _row(job_dir: Path, trial: Any) -> TrialRow:
    overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or []
    record = read_record(job_dir) or {}
    summary_path = job_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    objective = record.get("best", summary.get("val/miou"))
    status = "complete" if summary else "incomplete"
    if trial is not None:
        state = trial.state.name.lower()
        status = {"fail": "failed"}.get(state, state)
        if trial.user_attrs.get(INTERRUPTED):
            status = "interrupted"
        if state == "complete":
            objective = trial.value
    return TrialRow(_job_number(job_dir), job_dir, status,
                    None if objective is None else float(objective), list(overrides),
                    record, _seconds(job_dir))


def _no_jobs(folder: Path) -> str:
    """Why ``folder`` is not a sweep folder, and which folder to give instead."""
    give = "give the sweep folder (hydra.sweep.dir) of a `seg-train -m` run"
    if not folder.is_dir():
        return f"'{folder}' {'is not a folder' if folder.exists() else 'does not exist'}; {give}"
    if (folder / ".hydra" / "overrides.yaml").is_file():
        sweep = folder.resolve().parent
        if (sweep / "multirun.yaml").is_file():
            return (f"'{folder}' is one job of a sweep; give the sweep folder that holds it: "
                    f"seg-sweep-report {sweep}")
        return f"'{folder}' is the folder of one run, not of a sweep; {give}"
    below = sorted({p.parent.parent.parent for depth in ("*/*", "*/*/*")
                    for p in folder.glob(f"{depth}/.hydra/overrides.yaml")
                    if (p.parent.parent.parent / "multirun.yaml").is_file()})
    if below:
        shown = ", ".join(str(p) for p in below[:5]) + (", ..." if len(below) > 5 else "")
        return f"'{folder}' holds no Hydra job folders itself; the sweep folders below it: {shown}"
    return f"'{folder}' holds no Hydra job folders (*/.hydra/overrides.yaml): {give}"


def collect_trials(folder: str | Path, study_name: str | None = None) -> SweepReport:
    """Read every job folder of a sweep (and its optuna study, when there is one).

    Args:
        folder: the sweep folder (``hydra.sweep.dir``).
        study_name: the study to read from ``optuna.db`` when it holds several.

    Raises:
        FileNotFoundError: the folder holds no Hydra job, and is no sweep whose every job
            was refused before its run began (``multirun.yaml`` or a study beside them).
    """
    folder = Path(folder)
    jobs = sorted(p.parent.parent for p in folder.glob("*/.hydra/overrides.yaml"))
    unrecorded = _no_record(folder) if folder.is_dir() else []
    swept = (folder / "multirun.yaml").is_file() or (folder / STUDY_FILE).is_file()
    if not jobs and not (unrecorded and swept):
        raise FileNotFoundError(_no_jobs(folder))
    trials, direction = _study_trials(folder, study_name)
    grid = _grid_jobs(folder) if unrecorded and not trials else []
    rows = sorted([*(_row(j, trials.get(_job_number(j))) for j in jobs),
                   *(_unrecorded(j, trials.get(_job_number(j)), grid) for j in unrecorded)],
                  key=lambda r: r.job)
    if direction is None:
        modes = {r.record.get("mode") for r in rows} - {None}
        direction = "minimize" if modes == {"min"} else "maximize"
    params = _searched_keys(rows, trials, folder)
    done = [r for r in rows if r.status == "complete" and r.objective is not None
            and math.isfinite(r.objective)]
    pick = max if direction == "maximize" else min
    best = pick(done, key=lambda r: cast(float, r.objective)) if done else None  # done: set
    return SweepReport(folder, rows, params, direction, best)


def _no_record(folder: Path) -> list[Path]:
    """Job folders (``<n>_...``) of the sweep that hold no config: refused or stopped early.

    A trial refused before its run began (a grid the data cannot take) leaves its folder
    with Hydra's log alone; it was missing from the report.
    """
    return sorted(d for d in folder.iterdir() if d.is_dir() and d.name.split("_")[0].isdigit()
                  and not (d / ".hydra" / "overrides.yaml").is_file())


def _unrecorded(job_dir: Path, trial: Any, grid: Sequence[list[str]] = ()) -> TrialRow:
    """A job that saved no config: failed (its ``train.log`` says why), or the study's state.

    Its overrides are the grid's job of its number (``grid``: :func:`_grid_jobs`), if any.
    """
    state = trial.state.name.lower() if trial is not None else "fail"
    job = _job_number(job_dir)
    overrides = list(grid[job]) if 0 <= job < len(grid) else []
    return TrialRow(job, job_dir, {"fail": "failed"}.get(state, state), None, overrides)


def _command_line(folder: Path) -> list[Any]:
    """The sweep's command-line overrides (``multirun.yaml``), as Hydra's parser reads them.

    A dict or list value (``a=[1,2]``, ``b={x:1,y:2}``) is one value, not a sweep.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        doc = yaml.safe_load((folder / "multirun.yaml").read_text())
        task = doc["hydra"]["overrides"]["task"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return []
    parser, parsed = OverridesParser.create(), []
    for o in task if isinstance(task, list) else []:
        try:
            parsed.append(parser.parse_override(str(o)))
        except HydraException:
            continue
    return parsed


def _swept(folder: Path) -> list[str]:
    """The keys the sweep's command line swept (``multirun.yaml``): ``a=1,2``, ``choice(...)``."""
    return [o.get_key_element().lstrip("+~") for o in _command_line(folder)
            if o.is_sweep_override()]


def _grid_jobs(folder: Path) -> list[list[str]]:
    """A grid sweep's jobs' overrides, in job order, as Hydra's grid sweeper made them.

    Empty for a sweep of ranges an optimiser draws from (no grid).
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.errors import HydraException

    parsed = _command_line(folder)
    if any(o.is_sweep_override() and not o.is_discrete_sweep() for o in parsed):
        return []
    try:
        return BasicSweeper.split_arguments(parsed, None)[0]
    except HydraException:
        return []


def _searched_keys(rows: Sequence[TrialRow], trials: dict[int, Any],
                   folder: Path | None = None) -> list[str]:
    """The keys a sweep searched.

    The study's parameters, else the keys the command line swept, else the override keys
    whose values differ between jobs.
    """
    keys: list[str] = []
    for t in trials.values():
        keys += [k for k in t.params if k not in keys]
    if keys:
        return keys
    if folder is not None and (swept := _swept(folder)):
        return swept
    seen: dict[str, set[str | None]] = {}
    for r in rows:
        for o in r.overrides:
            k = o.partition("=")[0].lstrip("+~")
            if not o.startswith(NOT_PARAMS):
                seen.setdefault(k, set())
    for k in seen:
        seen[k] = {r.value_of(k) for r in rows}
    varying = [k for k, v in seen.items() if len(v) > 1]
    return varying or list(seen)


def best_command(row: TrialRow) -> str:
    """``seg-train <the row's overrides>``: the sweep's own switches left out."""
    kept = [o for o in row.overrides if not o.startswith(NOT_PARAMS)]
    return " ".join(["seg-train", *(shlex.quote(o) for o in kept)])


def _cells(report: SweepReport) -> tuple[list[str], list[list[str]]]:
    head = ["job", "status", "objective", *report.params, "seconds", "fit_s", "epochs",
            "best_epoch", "peak_mem_mib", "threads", "overrides", "run"]
    body = []
    for r in report.rows:
        rec = r.record
        body.append([str(r.job), r.status, "" if r.objective is None else repr(r.objective),
                     *("" if r.value_of(k) is None else str(r.value_of(k))
                       for k in report.params),
                     "" if r.seconds is None else str(r.seconds),
                     *(str(rec.get(k, "")) for k in ("fit_s", "epochs", "best_epoch",
                                                     "peak_mem_mib", "threads")),
                     " ".join(r.overrides), str(r.run)])
    return head, body


def _short(text: str, width: int) -> str:
    """A cell for the text table: numbers to 4 significant digits, keys by their last part."""
    try:
        value = float(text)
    except ValueError:
        return text.rsplit(".", 1)[-1][:width] if "=" not in text else text[:width]
    return text[:width] if value.is_integer() and "." not in text else f"{value:.4g}"


def format_table(report: SweepReport, width: int = 12) -> str:
    """The report as aligned text (without the override and folder columns)."""
    head, body = _cells(report)
    keep = len(head) - 2
    lines = ["  ".join(_short(h, width).ljust(width) for h in head[:keep])]
    lines += ["  ".join(_short(c, width).ljust(width) for c in row[:keep]) for row in body]
    return "\n".join(line.rstrip() for line in lines)


def write_report(folder: str | Path, study_name: str | None = None) -> SweepReport:
    """Write ``sweep_report.csv``, ``sweep_report.png`` and ``best_command.txt`` in ``folder``."""
    from seg_at_scale.sweeps.plot import save_report_figure

    report = collect_trials(folder, study_name)
    head, body = _cells(report)
    with open(report.folder / CSV_FILE, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(head)
        writer.writerows(body)
    save_report_figure(report, report.folder / PNG_FILE)
    if report.best is not None:
        (report.folder / COMMAND_FILE).write_text(best_command(report.best) + "\n")
    return report


def summary_text(report: SweepReport) -> str:
    """What the command prints: the table, the files, the best run as a command."""
    done = sum(r.status == "complete" for r in report.rows)
    text = [format_table(report), "",
            f"{len(report.rows)} trials ({done} complete) in {report.folder}",
            f"report: {report.folder / CSV_FILE}, {report.folder / PNG_FILE}"]
    if report.best is not None:
        text += [f"best: job {report.best.job}, objective {report.best.objective:.4f} "
                 f"({report.direction})", f"  {best_command(report.best)}"]
    return "\n".join(text)


class SweepReportCallback(Callback):
    """Hydra callback: write the report when a multirun ends, however it ends.

    Hydra calls ``on_multirun_end`` only when every trial succeeded: a failed trial (the
    grid sweeper raises at the first), more failed optuna trials than ``max_failures`` or
    Ctrl+C ended the multirun with no report of the trials that did finish. The sweep
    folder is noted when the multirun starts; :func:`report_unended_multiruns` (called by
    ``seg-train`` whatever Hydra raised) writes the report of one that did not end.
    """

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        _UNENDED.append(Path(str(config.hydra.sweep.dir)))

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        folder = Path(str(config.hydra.sweep.dir))
        if folder in _UNENDED:
            _UNENDED.remove(folder)
        _report(folder)


#: Sweep folders whose multirun started in this process and has not ended.
_UNENDED: list[Path] = []


def _report(folder: Path, *, after_failure: bool = False) -> None:
    try:
        report = write_report(folder)
    except (FileNotFoundError, ValueError) as e:  # no trial folder yet
        if not after_failure:
            log.warning("no sweep report for %s: %s", folder, e)
        return
    print(summary_text(report), flush=True)


def report_unended_multiruns() -> None:
    """Write the report of each multirun that started here and did not end (a trial failed).

    A sweep stopped before any trial made its folder gets none, silently: its error says
    what happened.
    """
    while _UNENDED:
        _report(_UNENDED.pop(), after_failure=True)


def main(argv: Sequence[str] | None = None) -> None:
    """``seg-sweep-report <sweep folder> [--study NAME]``."""
    parser = argparse.ArgumentParser(prog="seg-sweep-report", description=__doc__.split("\n")[0])
    parser.add_argument("folder", help="the sweep folder (hydra.sweep.dir)")
    parser.add_argument("--study", default=None, help="study name when optuna.db holds several")
    args = parser.parse_args(argv)
    try:
        report = write_report(args.folder, args.study)
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"seg-sweep-report: {e}\n")
    print(summary_text(report))


if __name__ == "__main__":
    main()
