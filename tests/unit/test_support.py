"""Which Python goes with which Celery: README's table, the package's metadata and CI's legs agree."""

from __future__ import annotations

import configparser
import importlib.metadata
import re
from pathlib import Path
from typing import List, Tuple

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def table() -> List[Tuple[List[str], str, str, str]]:
    """README's rows: (the Python versions, the oldest Celery, the newest Celery, what CI runs)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("**Which Python, which Celery.**"):]
    rows = []
    for line in section.splitlines()[5:]:
        if not line.startswith("| "):
            break
        python, celery, ci = (cell.strip() for cell in line.strip("|").split("|"))
        first, _, last = python.partition(" to ")
        minors = range(int(first.split(".")[1]), int((last or first).split(".")[1]) + 1)
        oldest, newest = celery.split(" to ")
        rows.append(([f"3.{minor}" for minor in minors], oldest, newest, ci))
    return rows


def celery_for(python: str) -> List[Requirement]:
    """The package's Celery requirements that apply on ``python``."""
    requirements = [Requirement(r) for r in importlib.metadata.requires("celery-zklock") or []]
    return [r for r in requirements if r.name == "celery" and (r.marker is None or r.marker.evaluate(
        {"python_version": python, "extra": ""}))]


def test_the_readme_table_is_what_the_package_metadata_allows():
    rows = table()
    assert [row[0] for row in rows] == [["3.9"], ["3.10", "3.11", "3.12", "3.13"]]
    metadata = importlib.metadata.metadata("celery-zklock")
    classified = sorted((c.rsplit(" :: ", 1)[1] for c in metadata.get_all("Classifier") or []
                         if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)), key=Version)
    assert classified == [python for pythons, *_ in rows for python in pythons]
    assert metadata["Requires-Python"] == f">={rows[0][0][0]}"
    for pythons, oldest, newest, _ in rows:
        for python in pythons:
            (requirement,) = celery_for(python)
            major, minor = (int(part) for part in oldest.split("."))
            assert Version(f"{oldest}.0") in requirement.specifier, (python, requirement)
            assert Version(f"{major}.{minor - 1}.99") not in requirement.specifier, (python, requirement)
            assert Version(f"{newest}.0") in requirement.specifier and Version(f"{newest}.99") in requirement.specifier
            if newest != "5.7":  # the newest Celery there is: past it, Celery has not said
                major, minor = (int(part) for part in newest.split("."))
                assert Version(f"{major}.{minor + 1}.0") not in requirement.specifier, (python, requirement)


def test_the_oldest_leg_ci_runs_is_the_one_the_table_names():
    # CI (.ci/run) runs `make test-oldest`, which runs tox's py39-celeryoldest.
    assert "make test-oldest" in (ROOT / ".ci" / "run").read_text()
    assert "tox -e py39-celeryoldest" in (ROOT / "Makefile").read_text()
    tox = configparser.ConfigParser()
    tox.read(ROOT / "tox.ini")
    pins = dict(re.findall(r"celeryoldest: (\w+)==([\d.]+)", tox["testenv"]["deps"]))
    (pythons, _, _, ci), = [row for row in table() if row[3].startswith("`make test-oldest`")]
    assert pythons == ["3.9"]
    assert f"Celery {pins['celery']} and kazoo {pins['kazoo']}" in ci
    (requirement,) = celery_for("3.9")
    assert Version(pins["celery"]) in requirement.specifier
