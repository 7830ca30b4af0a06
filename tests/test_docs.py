"""The manual builds from the repository alone: README and docs/ link only to files that
exist in it, nothing points outside the project, and docs/benchmarks.md is what
experiments/report.py makes of experiments/results/."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.stdout.splitlines()]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves_inside_the_repository(page: Path) -> None:
    for target, _ in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path = (page.parent / target).resolve()
        assert path.is_relative_to(ROOT), f"{page.name} links outside the project: {target}"
        assert path.exists(), f"{page.name} links to a missing file: {target}"


def test_nothing_points_outside_the_project() -> None:
    pattern = re.compile(r"\.\./shared|shared/DESIGN|shared/STYLE")
    offenders = []
    for path in _tracked():
        if path.suffix not in {".py", ".md", ".yaml", ".yml", ".toml", ".sbatch", ".cfg",
                               ".ipynb", ""} or not path.is_file():
            continue
        if path == Path(__file__).resolve():
            continue
        text = path.read_text(errors="replace")
        if pattern.search(text):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_the_readme_is_a_manual() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 450
    assert max(len(line) for line in text.splitlines()) <= 400
    for page in [*PAGES, ROOT / "CHANGELOG.md"]:
        body = page.read_text()
        assert not re.search(r"\bstop \d+", body, re.I), f"{page.name} refers to a stop"


def test_benchmarks_page_is_generated_from_the_results() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "report.py"), "--check"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_report_renders_one_section_per_result(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import report
    finally:
        sys.path.pop(0)
    (tmp_path / "bench_x.json").write_text(
        '{"benchmark": "bench_x", "commit": "abc1234", "date": "2026-01-02 03:04", '
        '"machine": {"cpu": "CPU", "cores": 3}, "loadavg_at_save": [1.5, 1.0, 0.5], '
        '"speedup": 1.2345678}')
    page = report.render(tmp_path)
    assert ("| abc1234 | 2026-01-02 03:04 | CPU, 3 cores | loadavg_at_save: [1.5, 1.0, 0.5] |"
            in page)
    assert "| `speedup` | 1.235 |" in page
