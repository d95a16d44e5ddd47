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
from types import ModuleType, SimpleNamespace
from typing import Dict, List

import click
import pytest

from celery_zklock.conf import DEFAULTS, DESCRIPTIONS
from tests import doc_commands
from tests.browser import browser, measured, screenshot
from tests.doc_commands import Command, parsed, printed_commands
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


SETTINGS_PAGE = ROOT / "docs" / "reference" / "settings.md"


def test_the_settings_table_is_in_the_pages_file_and_is_the_codes():
    # In the file itself: a repository host shows the raw Markdown, and no build hook runs there.
    settings = hook("settings")
    page = SETTINGS_PAGE.read_text(encoding="utf-8")
    assert settings.table_in(page) == settings.settings_table(), "write it again: python docs/hooks/settings.py"
    for name in DEFAULTS:
        assert f"\n| `{name}` |" in page
    assert settings.with_table(page) == page


def test_the_sites_build_refuses_a_settings_table_that_is_not_the_codes():
    settings = hook("settings")
    page = SETTINGS_PAGE.read_text(encoding="utf-8")
    settings_page = SimpleNamespace(file=SimpleNamespace(src_uri="reference/settings.md"))
    assert settings.on_page_markdown(page, page=settings_page) == page
    stale = page.replace("| `zklock_root` |", "| `zklock_rot` |")
    with pytest.raises(ValueError, match=r"not celery_zklock\.conf's; write it again with: python docs/hooks/settings"):
        settings.on_page_markdown(stale, page=settings_page)


@pytest.mark.parametrize("name", ["include", "settings", "breaks"])
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


# -- the commands they print -----------------------------------------------------------------------------
PRINTED = printed_commands()


def test_the_printed_commands_are_found():
    # The ones the alert runbooks give, in every form they are printed in (folded YAML, Markdown, fenced blocks).
    found = {" ".join(c.words) for c in PRINTED}
    assert {"-A proj control terminate SIGTERM TASK_ID", "-A proj zklock evict KEY", "-A proj zklock locks --waiters",
            "-A proj zklock clear-queued --task proj.sync --key sync:7", "worker -B --scheduler zklock"} <= found
    assert len({c.where.split(":")[0] for c in PRINTED}) > 10


@pytest.mark.parametrize("command", PRINTED, ids=str)
def test_every_printed_command_is_accepted_by_celerys_command_line(command: Command):
    # The runbooks told operators `celery -A proj control revoke --terminate TASK_ID`, which Celery 5 refuses
    # ("No such option '--terminate'"): each command printed anywhere is parsed as `celery` itself parses it.
    try:
        parsed(command.argv())
    except click.ClickException as e:
        pytest.fail(f"{command}\n  celery refuses it: {e.format_message()}")


def test_celerys_command_line_refuses_what_it_should():
    refused = ["-A proj control revoke --terminate TASK_ID", "-A proj control kill TASK_ID", "-A proj inspect revoke",
               "-A proj zklock evict KEY --nod PATH", "-A proj zklock evicts KEY", "-A proj zklock exporter --port N0",
               "-A proj control rate_limit proj.sync 5/s extra"]
    for words in refused:
        with pytest.raises(click.ClickException):
            parsed(Command("here", tuple(words.split())).argv())
            pytest.fail(f"accepted: celery {words}")


def test_doc_commands_docstring_examples():
    result = doctest.testmod(doc_commands)
    assert result.failed == 0 and result.attempted > 0


# -- troubleshooting -------------------------------------------------------------------------------------
def troubleshooting_entry(title: str) -> str:
    """The text of one entry (a ``- **title**...`` item) of the troubleshooting page."""
    page = (ROOT / "docs" / "operations" / "troubleshooting.md").read_text(encoding="utf-8")
    items = re.split(r"^- ", page, flags=re.MULTILINE)
    [item] = [i for i in items if i.startswith(f"**{title}**")]
    return " ".join(item.split())


def test_a_stuck_lock_is_freed_by_ending_its_task_then_by_evict_and_it_says_when_evict_is_safe():
    entry = troubleshooting_entry("A lock seems stuck")
    commands = [c.group(1) for c in re.finditer(r"`(celery [^`]+)`", entry)]
    assert commands[1:] == ["celery -A proj control terminate SIGTERM TASK_ID", "celery -A proj zklock evict KEY"]
    assert "When that is safe" in entry and "fencing token" in entry and "--node PATH" in entry


# -- the built site, as a browser lays it out ---------------------------------------------------------
def built_site(into: Path) -> Path:
    """The site built from this tree with mkdocs (about 3 s), or else the one `make docs` left in site/."""
    if importlib.util.find_spec("mkdocs") is None:
        assert (ROOT / "site" / "index.html").exists(), "no mkdocs to build the site, and no site/: run `make docs`"
        return ROOT / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(into)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr
    return into


def test_the_site_in_chromium_keeps_names_whole_and_code_blocks_in_sight(tmp_path: Path):
    # A reader saw setting names cut mid-word ("zklock_sess/ion_timeou/t"), code blocks cut off at the
    # right (overlay scrollbars show no sign of the rest), then, once blocks wrapped, `status`'s table
    # wrapped into unreadable lines and `maxSessionTimeout` cut as "maxSessi" / "onTimeout" in a
    # description. Measured in the laid-out pages: a name in a table is on one line; no inline code breaks
    # between two letters, nor runs past the page (but in a table that scrolls); a code block wider than
    # its box scrolls (with a scrollbar) and stays in the page; and only a block marked as prose
    # (<div class="wrap" markdown>) wraps its lines.
    if browser() is None:
        pytest.skip("Chromium is not installed (`make system` installs Debian's chromium): the site's layout "
                    "is not checked")
    site = built_site(tmp_path / "site")
    pages = sorted(p.parent.relative_to(site).as_posix() + "/" for p in site.rglob("index.html")
                   if p.parent != site and p.parent.name not in ("search", "assets"))
    frames = [(page or "home", page, 1280) for page in ["", *pages]]
    frames.append(("phone: reference/settings/", "reference/settings/", 390))
    found = measured(site, frames)
    # Each setting's name and default were measured, and the metric families', and the site's inline code.
    assert found["reference/settings/"]["names"] >= len(DEFAULTS) + 10, found["reference/settings/"]
    assert found["operations/metrics/"]["names"] > 20
    assert sum(page["inline"] for page in found.values()) > 500
    blocks = [(page, block) for page, seen in found.items() for block in seen["blocks"]]
    assert len(blocks) > 20
    # `status`'s sample has lines longer than its box at 1280 px: the checks below are put to the test.
    assert any(b["wide"] or b["wrapped"] for b in found["operations/cli/"]["blocks"]), found["operations/cli/"]
    problems = [f"{page}: {name!r} broken over lines" for page, seen in found.items() for name in seen["broken_names"]]
    problems += [f"{page}: inline code broken mid-word: {at!r}" for page, seen in found.items()
                 for at in seen["broken_inline"]]
    problems += [f"{page}: inline code past the page's edge: {code!r}" for page, seen in found.items()
                 for code in seen["hidden_inline"]]
    # The settings table fits the page at 1280 px: a description is read without scrolling sideways.
    problems += [f"reference/settings/: table wider than the page: {header!r}"
                 for header in found["reference/settings/"]["wide_tables"]]
    problems += [f"{page}: code block cut off at the right: {b['first'][:80]!r}" for page, b in blocks
                 if (b["wide"] and not b["scrolls"]) or not b["inside"]]
    problems += [f"{page}: code block wraps its lines: {b['first'][:80]!r}" for page, b in blocks
                 if b["wrapped"] and not b["prose"]]
    if problems:
        screenshot(site, "reference/settings/", tmp_path / "settings.png")
        screenshot(site, "operations/cli/", tmp_path / "cli.png")
        problems.append(f"(the settings and CLI pages as drawn: {tmp_path / 'settings.png'}, {tmp_path / 'cli.png'})")
    assert problems == [], "\n".join(problems)
