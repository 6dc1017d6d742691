"""The examples in dsched's docstrings run, as written, against the installed package."""

import doctest
import importlib
import pkgutil

import pytest

import dsched

# Modules whose import needs an optional dependency, or runs a program.
SKIPPED = {"dsched.__main__"}


def _modules():
    names = [info.name for info in pkgutil.walk_packages(dsched.__path__, "dsched.")]
    return sorted(set(names) - SKIPPED)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
    try:
        module = importlib.import_module(name)
    except ImportError as err:  # an optional dependency this machine lacks (torch, neml2, ...)
        pytest.skip(f"{name}: {err}")
    failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert failures == 0, f"{failures} docstring example(s) of {name} failed (run python -m doctest -v on it)"
