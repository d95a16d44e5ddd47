"""The documentation is true: its examples compile, type-check and run, and its reference matches the code.

The examples and their markers are described in ``tests/doc_examples.py``; the ones that
need a ZooKeeper server run in ``tests/integration/test_docs_examples.py``.
"""

from __future__ import annotations

import doctest
import importlib.util
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Dict, List

import pytest

from celery_zklock.conf import DEFAULTS, DESCRIPTIONS
from tests.doc_examples import EXAMPLES, PROBLEMS, ROOT, Example, documents


def hook(name: str) -> ModuleType:
    """One of the site's build hooks (docs/hooks/), imported from its file."""
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", ROOT / "docs" / "hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the examples ---------------------------------------------------------------------------------
def test_every_python_block_says_how_it_is_checked():
    assert PROBLEMS == []
    assert {e.kind for e in EXAMPLES} >= {"run", "zookeeper", "pytest", "fragment"}


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_example_compiles(example: Example):
    compile(example.source, str(example), "exec")


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e.kind == "run"], ids=str)
def test_example_runs(example: Example, caplog: pytest.LogCaptureFixture):
    namespace = example.run()
    with caplog.at_level(logging.ERROR, logger="celery_zklock"):
        namespace["app"].finalize()  # where a task's wrong lock option is reported
    assert [r.getMessage() for r in caplog.records if r.name.startswith("celery_zklock")] == []


#: A line the type check must report, so that it is known to see celery_zklock's own types.
CANARY = 'from celery_zklock import lock_path\n\nnot_a_path: int = lock_path(None, "k")\n'


def test_examples_type_check(tmp_path: Path):
    pytest.importorskip("mypy", reason="mypy is in the lint dependency group")
    by_file: Dict[str, Example] = {}
    for example in EXAMPLES:
        (tmp_path / f"{example.module}.py").write_text(example.source, encoding="utf-8")
        by_file[f"{example.module}.py"] = example
    (tmp_path / "canary.py").write_text(CANARY, encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--check-untyped-defs",
         "--no-error-summary", "--show-error-codes", "--cache-dir", str(ROOT / ".mypy_cache" / "docs_examples"),
         *sorted(by_file), "canary.py"],
        cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "MYPYPATH": str(ROOT)}, timeout=600,
    )
    findings: List[str] = []
    canary_seen = False
    for line in result.stdout.splitlines():
        m = re.match(r"^(?P<file>[^:]+\.py):(?P<line>\d+): (?P<message>.*)$", line)
        if m and m["file"] == "canary.py":
            canary_seen = canary_seen or 'has type "str", variable has type "int"' in m["message"]
        elif m and m["file"] in by_file:
            findings.append(f"{by_file[m['file']].markdown_line(int(m['line']))}: {m['message']}")
        elif line.strip():
            findings.append(line)
    assert canary_seen, f"mypy did not see celery_zklock's types:\n{result.stdout}{result.stderr}"
    assert findings == [], "\n".join(findings)


# -- the settings reference --------------------------------------------------------------------
def test_every_setting_has_a_type_and_a_description():
    assert sorted(DESCRIPTIONS) == sorted(DEFAULTS)
    for name, (kind, meaning) in DESCRIPTIONS.items():
        assert kind and meaning.strip(), name


def test_the_settings_reference_is_rendered_from_the_code():
    settings = hook("settings")
    page = (ROOT / "docs" / "reference" / "settings.md").read_text(encoding="utf-8")
    assert settings.MARKER in page
    rendered = settings.on_page_markdown(page)
    for name in DEFAULTS:
        assert f"| `{name}` |" in rendered


@pytest.mark.parametrize("name", ["include", "settings"])
def test_hook_docstring_examples(name: str):
    result = doctest.testmod(hook(name))
    assert result.failed == 0 and result.attempted > 0


# -- the front page ------------------------------------------------------------------------------
def test_the_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


def test_the_readmes_links_lead_somewhere():
    # Relative links must work on a code host (the file exists) and on the site (a page it includes).
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in t]
    assert targets
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert missing == []
    pages = hook("include").PAGES
    assert [t for t in targets if t and not t.startswith("docs/") and t not in pages] == []


def test_no_page_states_the_suites_size_or_duration():
    # Such figures change with every commit; the docs keep none of them.
    pattern = re.compile(r"\b\d[\d,]* tests\b|\bsuite\b[^.]*\b\d+(\.\d+)? (minutes|min|s)\b", re.IGNORECASE)
    found = [f"{path.relative_to(ROOT)}: {m.group(0)}" for path in documents()
             for m in pattern.finditer(path.read_text(encoding="utf-8"))]
    assert found == []


def test_the_install_lines_name_the_celery_the_suite_runs():
    # Users are told `celery[redis]>=5.6.3,<5.7` (tests/integration/test_broker_restart.py says
    # why); the test extra has the same upper bound, so the venv CI builds gets the Celery the
    # install line gets. From the installed metadata: tomllib needs Python 3.11.
    from importlib.metadata import requires

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    found = [Requirement(r) for r in requires("celery-zklock") or []]
    celery = [r for r in found if r.name == "celery" and r.marker is not None and r.marker.evaluate({"extra": "test"})]
    assert len(celery) == 1, "the test extra bounds no Celery (or twice)"
    assert "redis" in celery[0].extras

    def upper(specifier: SpecifierSet) -> List[str]:
        return [str(s) for s in specifier if s.operator == "<"]

    assert len(upper(celery[0].specifier)) == 1, f"the test extra's Celery has no single upper bound: {celery[0]}"
    for page in ("README.md", "docs/getting-started.md"):
        text = (ROOT / page).read_text(encoding="utf-8")
        lines = re.findall(r'pip install celery-zklock "celery\[redis\]([^"]*)"', text)
        assert len(lines) == 1, f"{page}: no install line, or several"
        assert upper(SpecifierSet(lines[0])) == upper(celery[0].specifier), page
