"""docs/parallel.md's "Running on Slurm" shows the sbatch scripts the Slurm tests submit,
verbatim."""

from __future__ import annotations

import pytest
from slurm_helpers import REPO, SCRIPTS


def _section() -> str:
    readme = (REPO / "docs" / "parallel.md").read_text()
    return readme[readme.index("## Running on Slurm"):]


@pytest.mark.parametrize("script", ["train.sbatch", "predict.sbatch"])
def test_the_readme_shows_the_script_the_tests_submit(script: str) -> None:
    text = (SCRIPTS / script).read_text()
    assert f"```bash\n{text}```" in _section(), \
        f"examples/slurm/{script} differs from docs/parallel.md"

