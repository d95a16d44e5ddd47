"""The docs' examples that need a server run against one: the plugin's ZooKeeper, with eager tasks.

``zookeeper`` blocks run after the preamble with ``app`` replaced by the plugin's
``zklock_app``; ``pytest`` blocks are test modules whose tests are called here with the
plugin's fixtures, as a user's pytest would call them. See ``tests/doc_examples.py``.
"""

from __future__ import annotations

import inspect
import logging
import re

import pytest

from tests.doc_examples import EXAMPLES, Example


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e.kind == "zookeeper"], ids=str)
def test_a_zookeeper_example_runs(example: Example, zklock_app, caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.ERROR, logger="celery_zklock"):
        example.run(app=zklock_app)
        zklock_app.finalize()
    assert [r.getMessage() for r in caplog.records if r.name.startswith("celery_zklock")] == []


#: Each test function of each documented test module: one item each, so each gets fresh fixtures.
DOCUMENTED_TESTS = [pytest.param(e, name, id=f"{e}::{name}")
                    for e in EXAMPLES if e.kind == "pytest" for name in re.findall(r"^def (test_\w+)", e.code, re.M)]


@pytest.mark.parametrize(("example", "name"), DOCUMENTED_TESTS)
def test_a_documented_test_passes(example: Example, name: str, request: pytest.FixtureRequest):
    test = example.run()[name]
    test(**{arg: request.getfixturevalue(arg) for arg in inspect.signature(test).parameters})


def test_every_documented_test_module_has_a_test():
    assert {e for e, _ in (p.values for p in DOCUMENTED_TESTS)} == {e for e in EXAMPLES if e.kind == "pytest"}
