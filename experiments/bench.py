"""The benchmarks' one command line: list them, or run one by name.

    .venv/bin/python experiments/bench.py list                   # every benchmark, one line each
    .venv/bin/python experiments/bench.py bench_fold             # results/bench_fold.json
    .venv/bin/python experiments/bench.py bench_fold --quick --out /tmp/r.json   # smoke run
    .venv/bin/python experiments/bench.py bench_fold --size 1024 # other arguments go to the script

A benchmark is a script of ``experiments/`` with a top-level ``main(argv)`` (``report.py`` and
this file aside); its description is the first paragraph of its module docstring. Each takes
``--quick`` (tiny sizes, the same code path and result schema, seconds) and ``--out PATH``
(default ``experiments/results/<name>.json``) and saves through :func:`common.save`. A
benchmark this machine cannot run (no CUDA device, no Slurm) prints one ``skipped: ...``
line, writes nothing and exits 0.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOT_BENCHMARKS = {"bench", "report"}


def _module(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def benchmarks() -> dict[str, str]:
    """``{name: one-line description}`` of every benchmark script, by name."""
    found = {}
    for path in sorted(HERE.glob("*.py")):
        if path.stem in NOT_BENCHMARKS:
            continue
        tree = _module(path)
        if not any(isinstance(node, ast.FunctionDef) and node.name == "main"
                   for node in tree.body):
            continue  # a helper module (common, gpu_common, the bench_gpu sections)
        doc = ast.get_docstring(tree) or ""
        first = doc.split("\n\n", 1)[0]
        found[path.stem] = " ".join(first.split())
    return found


def run(name: str, argv: list[str]) -> int:
    """``main(argv)`` of benchmark ``name``; its exit status."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))  # the scripts import common and each other
    sys.argv = [str(HERE / f"{name}.py"), *argv]  # argparse's program name and usage
    status = importlib.import_module(name).main(argv)
    return status if isinstance(status, int) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    known = benchmarks()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "list":
        width = max(map(len, known))
        for name, what in known.items():
            print(f"{name:<{width}}  {what}")
        return 0
    name, rest = argv[0].removesuffix(".py"), argv[1:]
    if name not in known:
        print(f"bench.py: no benchmark {name!r}; `bench.py list` names them", file=sys.stderr)
        return 2
    return run(name, rest)


if __name__ == "__main__":
    raise SystemExit(main())
