"""The test kit users get (celery_zklock.testing, the pytest plugin) stands apart from the
project's own rig, and its history check asks the lock's rules who may overlap whom."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from celery_zklock.glue.api import MODES, rule_for
from celery_zklock.testing import Hold, violations
from celery_zklock.testing.history import rule_of

PACKAGE = Path(__file__).resolve().parents[2] / "celery_zklock"


def test_the_package_never_imports_the_rig_the_tests_or_the_benchmarks():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {name}" for name in names
                      if name.split(".")[0] in ("harness", "tests", "benchmarks")]
    assert found == [], "the wheel ships celery_zklock alone: these would fail in a user's install"


def test_nothing_outside_the_tests_imports_or_runs_them():
    # The benchmarks, the rig and the example project have their own apps: a change to a test's
    # app must not move a benchmark's numbers. A module named in a string (a worker's or a
    # publisher's -A or -m) is run, so it counts; a docstring is prose, so it does not.
    found = []
    for room in ("benchmarks", "harness", "example_project"):
        for path in sorted((PACKAGE.parent / room).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            prose = {id(node.body[0].value) for node in ast.walk(tree)
                     if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
                     and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
                    names = [node.value]
                else:
                    continue
                found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {name}" for name in names
                          if name.split(".")[0] == "tests" and "." in name]
    assert found == [], "only tests/ may import or run tests/"


def test_loading_the_plugin_loads_no_test_kit():
    # What pytest does with the pytest11 entry point in every user's test run.
    code = "import sys, celery_zklock.pytest; print([m for m in sys.modules if m.startswith('celery_zklock.testing')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_holds_rule_is_the_rule_its_lock_runs_on(mode):
    assert rule_of(mode) == rule_for(mode)


def test_a_semaphore_holds_rule_has_its_limit():
    assert rule_of("semaphore", 3) == rule_for(limit=3)
    with pytest.raises(ValueError, match="mode must be one of"):
        rule_of("exclusvie")


def test_who_may_overlap_whom_is_the_rules_answer():
    def overlapping(*modes: str, limit: int = 1) -> list:
        return violations([Hold("k", mode, i, 0, 1, f"h{i}", limit) for i, mode in enumerate(modes)])

    assert overlapping("read", "read", "read") == []
    assert overlapping("read", "write") and overlapping("write", "read") and overlapping("exclusive", "write")
    assert overlapping("semaphore", "semaphore", limit=2) == []
    assert overlapping("semaphore", "semaphore", "semaphore", limit=2) == ["k: 3 holders at once (limit 2)"]
    # Rules whose nodes never block each other may overlap: a semaphore and a lock (which
    # celery_zklock also keeps under different paths for one key).
    assert overlapping("semaphore", "write") == []


def test_fencing_tokens_rise_under_every_rule_that_admits_one_holder():
    falling = [Hold("k", "semaphore", 7, 0, 1, "a", 1), Hold("k", "semaphore", 5, 1, 2, "b", 1)]
    assert violations(falling) == ["k: token 5 of b not above 7"]
    # Readers share: their tokens say nothing about order.
    assert violations([Hold("k", "read", 7, 0, 1, "a"), Hold("k", "read", 5, 1, 2, "b")]) == []


def test_a_server_that_cannot_start_leaves_no_directory_behind(monkeypatch, tmp_path):
    from celery_zklock.testing import ServerError, ZooKeeperServer

    monkeypatch.setenv("ZOOKEEPER_HOME", str(tmp_path / "no-such-release"))
    server = ZooKeeperServer()
    with pytest.raises(ServerError, match="holds no zookeeper jar"):
        server.start()
    assert not server.dir.exists()
