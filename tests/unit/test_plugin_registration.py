"""The pytest plugin loads both ways a user may enable it, and the two are one plugin.

pytest registers an autoloaded plugin under its ``pytest11`` entry point's name and a
``pytest_plugins`` module under the module's name: with any other entry point name, a
conftest that writes ``pytest_plugins = ("celery_zklock.pytest",)`` (as Celery's docs teach
for their own plugin) fails with "Plugin already registered under a different name".
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = 'pytest_plugins = ("celery_zklock.pytest",)\n'
TEST = '''
def test_the_fixtures_are_there(zklock_history, request):
    assert zklock_history.violations() == []
    assert request.config.pluginmanager.get_plugin("celery_zklock.pytest") is not None
'''


@pytest.mark.parametrize("autoload", [True, False], ids=["autoload", "PYTEST_DISABLE_PLUGIN_AUTOLOAD"])
def test_a_conftest_may_name_the_plugin_whether_or_not_it_is_autoloaded(tmp_path: Path, autoload: bool):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_uses_plugin.py").write_text(TEST)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    if not autoload:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
