"""The README's "Running on Slurm" shows the sbatch scripts the Slurm tests submit, verbatim
(``docs_slurm_section.md`` until it is merged into the README)."""

from __future__ import annotations

import pytest
from slurm_helpers import REPO, SCRIPTS


def _section() -> str:
    readme = (REPO / "README.md").read_text()
    if "## Running on Slurm" in readme:
        return readme
    return (REPO / "docs_slurm_section.md").read_text()


@pytest.mark.parametrize("script", ["train.sbatch", "predict.sbatch"])
def test_the_readme_shows_the_script_the_tests_submit(script: str) -> None:
    text = (SCRIPTS / script).read_text()
    assert f"```bash\n{text}```" in _section(), f"examples/slurm/{script} differs from the README"

