"""Shared pieces for the pure (``not slow``) tier that keep collection cheap.

`requires` is a module-level skip marker for optional libraries that checks only that the library is
installed (`importlib.util.find_spec`), without importing it: ``pytest.importorskip("transformers")`` at
module level imports transformers (~1 s) while the tests are collected, even when none of the file's
tests is selected. The tests import the library themselves (lazily, through the package) when they run.
"""

import importlib.util

import pytest


def requires(*names: str) -> pytest.MarkDecorator:
    """A ``skipif`` marker: skip when any of ``names`` (top-level module names) is not installed."""
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (not installed)")
