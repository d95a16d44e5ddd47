"""`make demo` keeps working: it runs end to end, finds every promise kept, and its summary adds up."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

#: The repository's root: `python -m example_project.demo` runs from there (here: through PYTHONPATH).
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def demo(tmp_path: Path) -> Tuple[subprocess.CompletedProcess, Path]:
    """One run of the demo (about 30 s): (its output, the directory it drew in). One test reads it, so
    that pytest-xdist cannot run the demo once per worker, as a module fixture shared by two tests may."""
    where = tmp_path
    out = subprocess.run([sys.executable, "-m", "example_project.demo"], cwd=where, capture_output=True, text=True,
                         timeout=90, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return out, where


@pytest.mark.slow
def test_demo_runs_and_keeps_every_promise(demo):
    out, where = demo
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "all promises kept" in out.stdout and "BROKEN" not in out.stdout
    assert "SKIPPED" in out.stdout and "after waiting" in out.stdout and "beat takeover after SIGKILL" in out.stdout
    assert "Connection dropped" not in out.stdout + out.stderr  # its own session ended before ZooKeeper
    # The timeline is in time order, although many processes write its history at once.
    times = [float(m.group(1)) for m in re.finditer(r"^ +(\d+\.\d\d)s  ", out.stdout, re.MULTILINE)]
    assert len(times) > 20 and times == sorted(times), times
    assert (where / "demo-timeline.png").stat().st_size > 10_000  # drawn by default (matplotlib is a test extra)
    # Where to scrape while it runs, and the scrapes drawn: each worker, each beat, and the exporter.
    urls = re.findall(r"^  (.+?) +http://127\.0\.0\.1:\d+/metrics$", out.stdout, re.MULTILINE)
    assert urls == [*(f"{p}'s metrics" for p in ("worker1", "worker2", "beat1", "beat2")),
                    "ZooKeeper's state (celery zklock exporter)"], out.stdout[:2000]
    assert (where / "demo-metrics.png").stat().st_size > 10_000
    summary_adds_up(out)


def summary(stdout: str) -> List[Tuple[int, str, str]]:
    """The summary's rows as (level, name, value): a row one level under a total is one of its parts."""
    assert "\nsummary" in stdout, stdout[-3000:]
    block = stdout.split("\nsummary", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    rows = []
    for line in block:
        found = re.match(r"^(  +)(\S.*?) {2,}(\S.*)$", line)
        assert found, f"not a summary row: {line!r}"
        rows.append(((len(found.group(1)) - 2) // 2, found.group(2), found.group(3)))
    return rows


def summary_adds_up(out: subprocess.CompletedProcess) -> None:
    """Every total is the sum of its parts, each thing is counted the same wherever it shows (the
    summary, the timeline's lines, the workers' metrics), and each feature happened at least once."""
    rows = summary(out.stdout)
    value: Dict[str, int] = {}
    totals = 0
    for i, (level, name, text) in enumerate(rows):
        if text.isdigit():
            assert name not in value, f"two rows named {name!r}"
            value[name] = int(text)
        parts = []
        for lower, part, part_text in rows[i + 1:]:
            if lower <= level:
                break
            if lower == level + 1:
                assert part_text.isdigit(), f"{part!r} under {name!r} is not a count: {part_text!r}"
                parts.append((part, int(part_text)))
        if parts:
            totals += 1
            assert text.isdigit() and int(text) == sum(n for _, n in parts), (name, text, parts)
    assert totals >= 6, rows  # publishes, copies, bodies, lock holds, contended locks, beat runs

    def row(prefix: str) -> int:
        named = [v for n, v in value.items() if n.startswith(prefix)]
        assert len(named) == 1, (prefix, value)
        return named[0]

    # Each level counts what the one above it handed down.
    assert row("copies sent") == row("sent a new copy")
    assert row("bodies run") == row("ran their body")
    assert row("skipped: their key was held") == row("skipped their task")
    assert row("parked without a slot") <= row("parked their copy")
    # The workers' own counts agree with the history the demo recorded.
    assert row("lock holds") == row("locks acquired, by the workers' metrics")
    assert row("locks found held") == row("contended, by the workers' metrics")
    # And with the timeline's lines, one per event.
    timeline = out.stdout.split("\nsummary", 1)[0]
    assert timeline.count(" held by ") == row("lock holds")
    assert timeline.count(" SKIPPED ") == row("skipped their task")
    assert timeline.count(" PARKED ") == row("parked their copy")
    assert timeline.count(" after waiting ") == row("waited for it, then held it")
    assert timeline.count(" DEDUPED ") == row("deduplicated")
    assert timeline.count(" dispatched by beat pid ") == row("beat runs dispatched")
    # Every feature the picture shows happened in this run.
    for feature in ("deduplicated", "skipped their task", "parked their copy", "waited for it", "read (",
                    "write (", "semaphore (", "rate ("):
        assert row(feature) >= 1, (feature, value)
    assert row("overlaps found") == 0 and row("beat runs sent twice") == 0
    assert 1 <= row("most starts of the quota key in any second") <= 3  # nine calls, three a second
    assert len([n for n in value if n.startswith("by beat")]) == 2, value  # the killed leader, then the standby
