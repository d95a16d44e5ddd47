"""A user's code type-checks against celery_zklock under ``mypy --strict``: a held lock's fencing
token is an ``int`` (the README's example passes it to a store typed ``fence: int``), and mypy
finds the package as installed, editable installs too (``make venv``'s, the README's)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, List, cast

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The README's example, without ``@app.task``: Celery ships no types, so under --strict its
#: decorator makes a function untyped whatever we do ("Untyped decorator"): Celery's part, not ours.
USER_CODE = '''
from typing import Any, List

import celery_zklock
from celery_zklock import Wait, current_lock, current_locks, zk_locked


def write(row: str, fence: int) -> None: ...


@zk_locked(key="invoice:{invoice_id}", on_contention=Wait(timeout=30))
def charge(invoice_id: int, amount: int) -> None:
    current_lock().ensure()
    write(f"{invoice_id}:{amount}", fence=current_lock().fencing_token)
    fences: List[int] = [held.fencing_token for held in current_locks()]
    print(fences)


def by_key(app: Any) -> None:
    with celery_zklock.lock(app, "report:2024", timeout=5) as held:
        write("report", fence=held.fencing_token)
'''

#: A user's strict configuration: only the libraries that ship no types are let off. Not
#: ``ignore_missing_imports`` for all: a celery_zklock mypy cannot find would pass as Any.
USER_CONFIG = """
[mypy]
strict = True
python_version = 3.9

[mypy-celery.*,kombu.*,kazoo.*,billiard.*,vine.*,prometheus_client.*,redis.*]
ignore_missing_imports = True

# Installed click and pytest use 3.10 syntax that a 3.9 target cannot parse (as in pyproject.toml).
[mypy-click,click.*,pytest,_pytest.*]
follow_imports = skip

# Our own modules are checked by `make lint`, under the project's settings: here only their types count.
[mypy-celery_zklock.*]
follow_imports = silent
"""


def mypy_errors(tmp_path: Path, env: Dict[str, str]) -> List[str]:
    """mypy's errors on USER_CODE, run as a user would, from a directory of their own."""
    pytest.importorskip("mypy", reason="mypy is in the lint dependency group")
    (tmp_path / "user_tasks.py").write_text(USER_CODE)
    (tmp_path / "mypy.ini").write_text(textwrap.dedent(USER_CONFIG))
    # Neither path leads mypy to the source tree unless a test asks: PYTHONPATH would (mypy asks
    # the interpreter for its sys.path), and pytest's own pythonpath is not passed on.
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--cache-dir", str(ROOT / ".mypy_cache" / "typing"),
         "user_tasks.py"], cwd=tmp_path, capture_output=True, text=True, env={**clean, **env}, timeout=600)
    errors = re.findall(r"^user_tasks\.py:\d+: error: .*$", result.stdout, re.M)
    assert errors or result.returncode == 0, result.stdout + result.stderr
    return errors


def test_a_held_locks_fencing_token_is_an_int_under_mypy_strict(tmp_path: Path):
    # From the source tree, whatever is installed: the types alone.
    assert mypy_errors(tmp_path, {"MYPYPATH": str(ROOT)}) == []


def test_mypy_finds_the_installed_package(tmp_path: Path):
    # As installed in this interpreter: setuptools' default editable install hides the package
    # behind an import hook that mypy does not run ("Cannot find implementation or library stub").
    assert mypy_errors(tmp_path, {}) == []


def test_a_lock_never_held_has_no_fencing_token_and_says_so():
    from celery_zklock import Lock, LockNotAcquired

    never = Lock(cast(Any, None), "/zklock/locks/k-report")  # no session is asked
    with pytest.raises(LockNotAcquired, match=r"lock /zklock/locks/k-report has no fencing token: it has never been"):
        print(never.fencing_token)
    assert "token=None" in repr(never)
