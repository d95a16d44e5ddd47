"""The Grafana dashboard and the Prometheus alerts in deploy/ ask only for what is served, and the alerts fire when
they should.

The families that exist are the workers' and beats' (:class:`celery_zklock.glue.metrics.Families`, as
prometheus_client exposes them) and the exporter's (:data:`celery_zklock.ops.exporter.FAMILIES`). A query
that names anything else, or a label its family lacks, shows an empty panel or an alert that never fires,
and nothing else would say so. promtool (taken out of Debian's ``prometheus`` package by ``make test``)
parses the rules and the dashboard's queries, and runs the rules' own unit tests,
``deploy/prometheus/celery-zklock-alerts.test.yml``.

The rules file is read here without a YAML library (the test extra has none): a rule is what follows
``- alert:``, and the count is checked against promtool's, so a rule this reading misses fails the test.
"""

from __future__ import annotations

import doctest
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, FrozenSet, Iterator, List, Set, Tuple

import pytest

from celery_zklock.glue.metrics import Families
from celery_zklock.ops.exporter import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "celery-zklock-alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "celery-zklock-alerts.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "celery-zklock.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}

# `make test` puts it beside the venv's python (taken out of Debian's package); tox's venvs have none.
PROMTOOL = shutil.which("promtool") or shutil.which("promtool", path=str(Path(__file__).resolve().parents[2]
                                                                          / ".venv" / "bin"))
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is missing: `make test` takes it out of Debian's prometheus package")

#: Labels Prometheus adds to every series it scrapes; a query may use them on any family.
TARGET_LABELS = frozenset({"job", "instance"})
#: The exporter's families that exist only with --per-key; the dashboard need not show them.
PER_KEY = frozenset(name for name, (labels, _) in FAMILIES.items() if "key" in labels)


# -- what is served -----------------------------------------------------------------------------
def worker_series() -> Dict[str, FrozenSet[str]]:
    """Each series name a worker or a beat serves, with its labels: every family counted once, then collected.

    The endpoints serve through prometheus_client's multiprocess collector, which serves no ``_created``
    series: a query on one would find nothing, so they are left out.
    """
    served: Dict[str, Set[str]] = {}
    for metric in vars(Families().beat()).values():
        described = metric.describe()[0]
        # How many labels to pass; the samples below say what they are called once exposed.
        child = metric.labels(*("x" for _ in metric._labelnames)) if metric._labelnames else metric
        if described.type == "counter":
            child.inc()
        elif described.type == "gauge":
            child.set(1)
        else:
            child.observe(1)
        for family in metric.collect():
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    served.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(labels) for name, labels in served.items()}


def exporter_series() -> Dict[str, FrozenSet[str]]:
    """The exporter's families: all gauges, each served under its own name."""
    return {name: frozenset(labels) for name, (labels, _) in FAMILIES.items()}


SERVED = {**worker_series(), **exporter_series()}


def family_of(series: str) -> str:
    """The family a served series belongs to: ``celery_zklock_wait_seconds_bucket`` -> ``..._wait_seconds``."""
    return re.sub(r"_(total|bucket|sum|count)$", "", series) if series not in FAMILIES else series


# -- what a query asks for, as far as a regex can tell -------------------------------------------------
_TOKEN = re.compile(r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<range>\[[^\]]*\])
  | (?P<duration>\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*\b)
  | (?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][\w:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=(){},])
  | (?P<space>\s+)
  | (?P<other>.)
""", re.VERBOSE)
#: Words that are PromQL's own: each of these is followed by a parenthesised list of labels.
_LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = _LABEL_LISTS | {"and", "or", "unless", "offset", "bool", "inf", "nan"}
_GRAFANA_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


def grafana_free(expr: str) -> str:
    """``expr`` with Grafana's variables replaced by what PromQL can parse: durations and regexes."""
    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        return "5m" if name.startswith("__") else ".*"

    return _GRAFANA_VARIABLE.sub(value, expr)


def tokens(expr: str) -> List[Tuple[str, str]]:
    found = [(m.lastgroup or "", m.group()) for m in _TOKEN.finditer(grafana_free(expr))]
    return [(kind, text) for kind, text in found if kind != "space"]


def problems(expr: str, served: Dict[str, FrozenSet[str]] = SERVED) -> List[str]:
    """What ``expr`` asks for that is not served: an unknown series, or a label its family lacks.

    >>> problems('sum by (task) (rate(celery_zklock_acquired_total{mode="write"}[5m]))')
    []
    >>> problems('sum by (reason) (rate(celery_zklock_acquired_total[5m]))')
    ['by (reason): not a label of every series inside']
    >>> problems('celery_zklock_holders{state="x"}')
    ['celery_zklock_holders has no label state']
    """
    found: List[str] = []
    toks = tokens(expr)
    closing: Dict[int, int] = {}
    opening: Dict[int, int] = {}
    stack: List[int] = []
    for i, (_, text) in enumerate(toks):
        if text == "(":
            stack.append(i)
        elif text == ")" and stack:
            start = stack.pop()
            closing[start], opening[i] = i, start
    if stack or len(closing) != sum(text == ")" for _, text in toks):
        return [f"unbalanced parentheses in {expr!r}"]
    # The labels of by (...), on (...) and the like: not series names.
    in_lists = {j for start, end in closing.items() if start and toks[start - 1][1] in _LABEL_LISTS
                for j in range(start + 1, end)}
    names: Dict[int, str] = {}  # token index -> series name
    in_braces = False
    for i, (kind, text) in enumerate(toks):
        nxt = toks[i + 1][1] if i + 1 < len(toks) else ""
        if kind == "op" and text in ("{", "}"):
            in_braces = text == "{"
            if in_braces and not (i and toks[i - 1][0] == "ident" and toks[i - 1][1] not in _KEYWORDS):
                found.append("a selector without a series name")
            continue
        # A function or an aggregation is followed by its arguments or by its by (...).
        if kind != "ident" or in_braces or i in in_lists or nxt in ("(", "by", "without") or text in _KEYWORDS:
            continue
        names[i] = text
        if text not in served:
            found.append(f"{text} is not served")
    # Labels in selectors: name{label="..."}
    for i, name in names.items():
        if i + 1 < len(toks) and toks[i + 1][1] == "{":
            j = i + 2
            while j < len(toks) and toks[j][1] != "}":
                if toks[j][0] == "ident" and j + 1 < len(toks) and toks[j + 1][1] in ("=", "!=", "=~", "!~"):
                    if name in served and toks[j][1] not in served[name] | TARGET_LABELS:
                        found.append(f"{name} has no label {toks[j][1]}")
                j += 1
    # Labels in by (...), without (...): each must be on every series inside the aggregation's body;
    # on (...), ignoring (...), group_left (...): on some series of the expression.
    for i, (_, text) in enumerate(toks):
        if text not in _LABEL_LISTS or i + 1 >= len(toks) or toks[i + 1][1] != "(":
            continue
        end = closing[i + 1]
        labels = [t for k, t in toks[i + 2:end] if k == "ident"]
        if text in ("by", "without"):
            if end + 1 < len(toks) and toks[end + 1][1] == "(":
                body = range(end + 1, closing[end + 1])  # sum by (x) (body)
            elif i and toks[i - 1][1] == ")":
                body = range(opening[i - 1], i - 1)  # sum (body) by (x)
            else:
                found.append(f"{text} ({', '.join(labels)}): no body found")
                continue
            inside = [names[j] for j in body if j in names and names[j] in served]
            allowed = frozenset.intersection(*(served[n] | TARGET_LABELS for n in inside)) if inside else None
        else:
            allowed = frozenset().union(*(served[n] for n in names.values() if n in served)) | TARGET_LABELS
        if allowed is not None and not set(labels) <= allowed:
            found.append(f"{text} ({', '.join(sorted(set(labels) - allowed))}): not a label of every series inside")
    return found


def series_named(expr: str) -> Set[str]:
    """The served families an expression reads."""
    return {family_of(text) for kind, text in tokens(expr) if kind == "ident" and text in SERVED}


# -- the rules file ----------------------------------------------------------------------------------
_RULE = re.compile(r"^\s*- alert: (?P<name>\w+)\s*$", re.MULTILINE)
_EXPR = re.compile(r"^(?P<indent>[ ]+)expr: (?:\|\n(?P<block>(?:(?P=indent)[ ]+\S.*\n)+)|(?P<inline>\S.*)\n)",
                   re.MULTILINE)


def alert_rules() -> Iterator[Tuple[str, str, str]]:
    """(name, expr, the rule's whole text) for each alerting rule in the rules file."""
    text = RULES.read_text(encoding="utf-8")
    starts = [m.start() for m in _RULE.finditer(text)]
    for start, end in zip(starts, starts[1:] + [len(text)]):
        chunk = re.split(r"\n[ ]*(?:#|- name:)", text[start:end])[0]  # not the comments of the rule after it
        name = _RULE.match(chunk)
        expr = _EXPR.search(chunk)
        assert name and expr, f"a rule the test cannot read: {chunk[:200]!r}"
        yield name["name"], " ".join((expr["block"] or expr["inline"]).split()), chunk


ALERTS = list(alert_rules())


# -- the dashboard -----------------------------------------------------------------------------------
def dashboard() -> Dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def panels(board: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
    """Every panel, those inside collapsed rows too, rows left out."""
    for panel in board["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def queries(board: Dict[str, Any]) -> Iterator[Tuple[str, str, str]]:
    """(where, expr, legend) for every query of every panel."""
    for panel in panels(board):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target.get('refId')}", target.get("expr", ""), \
                target.get("legendFormat", "")


# -- (a) and (b): promtool ---------------------------------------------------------------------------
def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_the_rules_pass_promtool_check():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    # The count keeps this file's reading of the rules honest: a rule it missed would go unchecked.
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


@needs_promtool
def test_each_alert_fires_when_it_should_and_not_when_it_should_not():
    result = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rules_unit_tests_cover_every_alert_both_ways():
    text = RULE_TESTS.read_text(encoding="utf-8")
    cases = re.findall(r"alertname: (\w+)(?:,\s*|\n\s*)exp_alerts:(\s*\[\])?", text)
    fires = {name for name, silent in cases if not silent}
    stays_silent = {name for name, silent in cases if silent}
    names = {name for name, _, _ in ALERTS}
    assert sorted(names - fires) == [], "alerts no test sees fire"
    assert sorted(names - stays_silent) == [], "alerts no test sees stay silent"
    assert {name for name, _ in cases} <= names, "tests of alerts the rules do not have"


@needs_promtool
def test_the_dashboards_queries_parse(tmp_path: Path):
    # As recording rules, with Grafana's variables filled in: promtool parses each one.
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for i, (_, expr, _) in enumerate(queries(dashboard())):
        lines += [f"      - record: dashboard:query_{i}", f"        expr: {json.dumps(grafana_free(expr))}"]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# -- (c) the dashboard asks only for what is served -------------------------------------------------
def test_every_dashboard_query_names_served_series_and_their_labels():
    found = [f"{where}: {problem}" for where, expr, _ in queries(dashboard()) for problem in problems(expr)]
    assert found == []


def test_every_legend_names_a_label_of_its_query():
    found = []
    for where, expr, legend in queries(dashboard()):
        allowed = frozenset().union(*(SERVED[t] for k, t in tokens(expr) if k == "ident" and t in SERVED))
        found += [f"{where}: {{{{{label}}}}}" for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend)
                  if label not in allowed | TARGET_LABELS]
    assert found == []


def test_every_panel_and_query_has_the_imported_datasource():
    board = dashboard()
    assert [(i["name"], i["type"], i["pluginId"]) for i in board["__inputs"]] == \
        [("DS_PROMETHEUS", "datasource", "prometheus")]
    found = []
    for panel in panels(board):
        if panel.get("datasource") != DATASOURCE:
            found.append(f"panel {panel['title']!r}: datasource {panel.get('datasource')!r}")
        if not panel.get("targets"):
            found.append(f"panel {panel['title']!r}: no query")
        refs = [t.get("refId") for t in panel.get("targets", [])]
        if len(set(refs)) != len(refs):
            found.append(f"panel {panel['title']!r}: refIds {refs}")
        for target in panel.get("targets", []):
            if target.get("datasource") != DATASOURCE or not target.get("expr", "").strip():
                found.append(f"panel {panel['title']!r} {target.get('refId')}: {target!r}")
    ids = [p["id"] for p in board["panels"]] + [p["id"] for p in panels(board) if p not in board["panels"]]
    assert len(set(ids)) == len(ids)
    assert found == []


def test_the_dashboards_variables_ask_for_served_labels():
    found = []
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        if variable.get("datasource") != DATASOURCE:
            found.append(f"${variable['name']}: datasource {variable.get('datasource')!r}")
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        # label_values(series, label), or over several: label_values({__name__=~"pre(a|b)post"}, label)
        m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query)
        several = re.fullmatch(r'label_values\(\{__name__=~"(\w*)\(([\w|]+)\)(\w*)"\},\s*(\w+)\)', query)
        names, label = ([m[1]], m[2]) if m else (
            [several[1] + alt + several[3] for alt in several[2].split("|")], several[4]) if several else ([], "")
        if not names or any(n not in SERVED or label not in SERVED[n] for n in names):
            found.append(f"${variable['name']}: {query}")
    assert found == []


def test_the_dashboard_shows_every_family():
    # A family no panel shows is one an operator cannot see; the exporter's --per-key ones are optional.
    shown = set().union(*(series_named(expr) for _, expr, _ in queries(dashboard())))
    families = {family_of(name) for name in SERVED} - PER_KEY
    assert sorted(families - shown) == []


# -- (d) the rules ask only for what is served, and say what to do -----------------------------------
@pytest.mark.parametrize("name, expr", [(name, expr) for name, expr, _ in ALERTS], ids=[n for n, _, _ in ALERTS])
def test_every_alert_names_served_series_and_their_labels(name: str, expr: str):
    assert problems(expr) == []


@pytest.mark.parametrize("name, chunk", [(name, chunk) for name, _, chunk in ALERTS], ids=[n for n, _, _ in ALERTS])
def test_every_alert_waits_has_a_severity_and_tells_the_operator_what_to_do(name: str, chunk: str):
    assert re.search(r"^\s+for: \d+[smh]\s*$", chunk, re.MULTILINE), "no for:"
    assert re.search(r"^\s+severity: (warning|critical)\s*$", chunk, re.MULTILINE), "no severity"
    assert re.search(r"^\s+summary: \S", chunk, re.MULTILINE), "no summary"
    description = re.search(r"^\s+description: (?:>-?|\|-?)?\n?(?P<text>(?:.*\n)+)", chunk, re.MULTILINE)
    assert description and "`celery " in description["text"], "a description that names no command to run"


def test_the_checks_fail_on_what_they_are_for():
    # Each kind of mistake the checks above look for, made on purpose.
    assert problems("rate(celery_zklock_acquired_totl[5m])") == ["celery_zklock_acquired_totl is not served"]
    assert problems("celery_zklock_acquired") == ["celery_zklock_acquired is not served"]  # no _total
    assert problems("celery_zklock_wait_seconds") == ["celery_zklock_wait_seconds is not served"]  # no _bucket
    assert problems('celery_zklock_lost_total{outcome="x"}') == ["celery_zklock_lost_total has no label outcome"]
    assert problems("sum by (le) (celery_zklock_wait_seconds_count)") == \
        ["by (le): not a label of every series inside"]
    assert problems("sum(celery_zklock_holders) by (beat)") == ["by (beat): not a label of every series inside"]
    assert problems('{__name__="celery_zklock_holders"}') == ["a selector without a series name"]
    assert problems('sum by (job, mode) (celery_zklock_holders{instance="e:1"}) > 0') == []


def test_this_modules_docstring_examples():
    result = doctest.testmod(sys.modules[__name__])
    assert result.failed == 0 and result.attempted > 0
