"""The ``>>>`` examples in the docstrings are part of the documentation: keep them true.

Every module of the package is discovered (none is listed by hand); a module whose
examples are all marked ``+SKIP`` (they need files) counts as having none. An example that
makes temporary files removes them: run in a folder of their own, nothing is left there.
"""

import doctest
import importlib
import pkgutil
import tempfile

import pytest

import seg_at_scale

MODULES = sorted(m.name for m in pkgutil.walk_packages(seg_at_scale.__path__, "seg_at_scale.")
                 if ".conf" not in m.name)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, tmp_path, monkeypatch):
    module = importlib.import_module(name)
    import timm  # noqa: F401 - its first import makes wandb's and torch's folders, not an example
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the examples' temporary files
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # removed by the example


def test_discovery_finds_the_modules_with_examples():
    with_examples = [n for n in MODULES
                     if doctest.DocTestFinder().find(importlib.import_module(n))
                     and any(t.examples for t in doctest.DocTestFinder().find(
                         importlib.import_module(n)))]
    assert len(MODULES) > 60 and len(with_examples) >= 25
    assert "seg_at_scale.tiling.engine" in with_examples
