"""Helpers shared by the tests: tiny runs, scenes and models in the real formats.

Imported as ``helpers.<name>`` (``tests/`` is on the path through its ``conftest.py``);
one module per part of the package they serve.
"""
