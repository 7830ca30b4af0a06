"""The sweep report's figure: the objective by trial, then by each searched parameter.

Drawn on a bare :class:`matplotlib.figure.Figure` (no pyplot, no global backend), so a
Hydra callback, the command line and a notebook can all call it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from seg_at_scale.sweeps.report import SweepReport, TrialRow

__all__ = ["report_figure", "save_report_figure"]

STYLE = {"complete": ("o", "tab:blue"), "pruned": ("x", "tab:gray"),
         "failed": ("v", "tab:red"), "interrupted": ("v", "tab:orange")}


def _number(text: str | None) -> float | None:
    try:
        value = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _by_trial(ax: Any, report: SweepReport) -> None:
    """Objective per job, marker by status, and the running best."""
    from matplotlib.ticker import MaxNLocator

    pick = max if report.direction == "maximize" else min
    best: float | None = None
    xs, ys = [], []
    for r in report.rows:
        if r.objective is None:
            continue
        marker, colour = STYLE.get(r.status, ("s", "tab:purple"))
        ax.scatter([r.job], [r.objective], marker=marker, color=colour)
        if r.status == "complete":
            best = r.objective if best is None else pick(best, r.objective)
            xs.append(r.job)
            ys.append(best)
    if xs:
        ax.step(xs, ys, where="post", color="tab:green", label="best so far")
        ax.legend(loc="best", fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial (job number)")
    ax.set_ylabel("objective")
    ax.set_title("objective by trial")


def _by_param(ax: Any, rows: Sequence[TrialRow], key: str, best: TrialRow | None) -> None:
    """Objective against one parameter: numbers on a (log) axis, categories by position."""
    from matplotlib.ticker import NullFormatter

    pts = [(r.value_of(key), r) for r in rows if r.objective is not None]
    numbers = [_number(v) for v, _ in pts]
    numeric = bool(pts) and all(n is not None for n in numbers)
    if numeric:
        xs: list[float] = [n for n in numbers if n is not None]
        positive = [x for x in xs if x > 0]
        if len(positive) == len(xs) and xs and max(xs) / min(xs) >= 20:
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
    else:
        labels = sorted({str(v) for v, _ in pts})
        xs = [float(labels.index(str(v))) for v, _ in pts]
        ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
    for x, (_, r) in zip(xs, pts):
        marker, colour = STYLE.get(r.status, ("s", "tab:purple"))
        ax.scatter([x], [r.objective], marker=marker, color=colour,
                   s=90 if r is best else 30, edgecolors="black" if r is best else "none")
    ax.set_xlabel(key, fontsize=9)
    ax.set_ylabel("objective")


def report_figure(report: SweepReport, columns: int = 3) -> Figure:
    """One panel for the objective by trial, one per searched key (best trial enlarged)."""
    from matplotlib.figure import Figure

    panels = 1 + len(report.params)
    cols = min(columns, panels)
    rows = math.ceil(panels / cols)
    fig = Figure(figsize=(4.2 * cols, 3.3 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    _by_trial(axes[0], report)
    for ax, key in zip(axes[1:], report.params):
        _by_param(ax, report.rows, key, report.best)
    for ax in axes[panels:]:
        ax.set_visible(False)
    best = (f"best job {report.best.job}: {report.best.objective:.4f}"
            if report.best is not None else "no complete trial")
    fig.suptitle(f"{report.folder.name}: {len(report.rows)} trials, {best}")
    return fig


def save_report_figure(report: SweepReport, path: str | Path) -> Path:
    """Draw :func:`report_figure` into a PNG."""
    fig = report_figure(report)
    fig.savefig(path, dpi=110)
    return Path(path)
