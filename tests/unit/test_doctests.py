"""The examples in the package's docstrings are true: each module's doctests run here."""

import doctest
import importlib
import pkgutil

import pytest

import celery_zklock

MODULES = sorted(m.name for m in pkgutil.walk_packages(celery_zklock.__path__, "celery_zklock."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
