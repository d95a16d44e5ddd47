"""`make demo` keeps working: it runs end to end and finds every promise kept."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

#: The repository's root: `python -m example_project.demo` runs from there (here: through PYTHONPATH).
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_runs_and_keeps_every_promise(tmp_path):
    out = subprocess.run([sys.executable, "-m", "example_project.demo"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=90, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "overlaps found in the history" in out.stdout and "all promises kept" in out.stdout
    assert "SKIPPED" in out.stdout and "after waiting" in out.stdout and "beat takeover after SIGKILL" in out.stdout
    deduplicated = re.search(r"publishes deduplicated \(copy queued\) +(\d+)", out.stdout)
    assert deduplicated and int(deduplicated.group(1)) >= 1, out.stdout
    assert "Connection dropped" not in out.stdout + out.stderr  # its own session ended before ZooKeeper
    # The timeline is in time order, although many processes write its history at once.
    times = [float(m.group(1)) for m in re.finditer(r"^ +(\d+\.\d\d)s  ", out.stdout, re.MULTILINE)]
    assert len(times) > 20 and times == sorted(times), times
    assert (tmp_path / "demo-timeline.png").stat().st_size > 10_000  # drawn by default (matplotlib is a test extra)
    # Where to scrape while it runs, and the scrapes drawn: each worker, each beat, and the exporter.
    urls = re.findall(r"^  (.+?) +http://127\.0\.0\.1:\d+/metrics$", out.stdout, re.MULTILINE)
    assert urls == [*(f"{p}'s metrics" for p in ("worker1", "worker2", "beat1", "beat2")),
                    "ZooKeeper's state (celery zklock exporter)"], out.stdout[:2000]
    assert (tmp_path / "demo-metrics.png").stat().st_size > 10_000
