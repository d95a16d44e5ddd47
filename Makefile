# Every target sets itself up: system packages, virtualenv, package.
# Servers are started by the test rig (celery_zklock/testing/, harness/) on
# free loopback ports and removed afterwards; nothing here touches 2181 or 6379.

PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# The package is installed editable in setuptools' compat mode: its default mode hides a flat
# layout's package behind an import hook, which type checkers never run, so mypy found no
# celery_zklock (tests/unit/test_typing.py). Part of the stamp: a venv made otherwise is redone.
EDITABLE_MODE = --config-settings editable_mode=compat
STAMP   = $(VENV)/.installed-$(shell { cat pyproject.toml; echo '$(EDITABLE_MODE)'; } | cksum | cut -d' ' -f1)
DOCS_STAMP = $(VENV)/.docs-$(shell { cat pyproject.toml; echo '$(EDITABLE_MODE)'; } | cksum | cut -d' ' -f1)
SUDO    = $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=
# Three pytest workers (pytest-xdist): the suite mostly waits (on servers starting, sessions
# expiring, workers taking over): at two, the two cores were 28% busy and `make test` took 24.5
# minutes; three take it to about 18. Under three, the ensemble and patrol-scale tests once failed:
# those were park bugs that load exposed (a claim whose nudge gave up, a viewer answered late),
# fixed with tests that place them. Each test starts its own servers on free ports.
# `make test PYTEST_WORKERS=0` runs it in one process.
PYTEST_WORKERS ?= 3
# The fast lane's and the oldest leg's tests are timed against sessions of a few seconds and
# were measured at two; they keep two.
LANE_WORKERS ?= 2

.PHONY: check test test-oldest lint docs demo bench chaos system venv clean

# The fast lane, about a minute on two cores (two at most): the linters, the unit tests, and the lock recipe's,
# the request path's, the interleavings' and the session's fault tests against real servers. What
# it covers and what it leaves to `make test`: docs/contributing.md.
CHECK_TESTS ?= tests/unit tests/integration/test_lock_recipe.py tests/integration/test_lock_contract.py \
	tests/integration/test_request_path.py tests/integration/test_interleavings.py \
	tests/integration/test_session_faults.py
check: lint system $(DOCS_STAMP) $(BIN)/promtool
	$(BIN)/python -m pytest -n $(LANE_WORKERS) $(PYTEST_ARGS) $(CHECK_TESTS)

# The docs tools too: a unit test builds the site and lays it out in Chromium.
test: system venv $(DOCS_STAMP) $(BIN)/promtool
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# The oldest Python, Celery and kazoo we support (tox env py39-celeryoldest): the unit tests and every
# test whose behaviour depends on Celery's version (tasks, beat, CLI, interleavings, the spans of the
# Celery instrumentation and the headers a parked copy carries its trace in), and the direct
# request path and the lock recipe, which lean on kazoo's internals and on the thread and socket
# behaviour of each Python.
PYTHON39 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.9*/bin/python3.9) $(shell command -v python3.9))
OLDEST_TESTS ?= tests/unit tests/integration/test_beat.py tests/integration/test_tasks.py \
	tests/integration/test_interleavings.py tests/integration/test_cli.py tests/integration/test_pytest_plugin.py \
	tests/integration/test_request_path.py tests/integration/test_lock_recipe.py tests/integration/test_lock_contract.py \
	tests/integration/test_tracing.py
test-oldest: system venv $(BIN)/promtool
	@[ -n "$(PYTHON39)" ] || { echo "error: no Python 3.9 found (install it, e.g. with pyenv, or set PYTHON39=)"; exit 1; }
	$(BIN)/tox -e py39-celeryoldest --skip-missing-interpreters false --discover $(PYTHON39) -- -p no:cacheprovider \
		-n $(LANE_WORKERS) $(OLDEST_TESTS)

# ruff (style, imports, bugbear, pyupgrade for py39) and mypy (targeting Python 3.9).
lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

# The documentation site, built into site/ (gitignored). --strict turns every warning (a broken link,
# a page left out of the nav) into a failure; NO_MKDOCS_2_WARNING quiets Material's end-of-life banner.
# Its own stamp (DOCS_STAMP, above): the lint and the demo need no docs tools.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[docs]' $(EDITABLE_MODE)
	@rm -f $(VENV)/.docs-*
	@touch $@

# The venv has the test extras, matplotlib among them: the demo draws demo-timeline.png.
# The demo and the benchmarks run as modules from here, where harness/ (the rig) is importable.
# DEMO_ARGS=--hold keeps its servers, workers, beats and exporter up after the summary, to scrape.
DEMO_ARGS ?=
demo: system venv
	$(BIN)/python -m example_project.demo $(DEMO_ARGS)

bench: system venv
	$(BIN)/python -m benchmarks.bench_lock --fsync --pin

chaos: system venv
	$(BIN)/python -m pytest -m chaos $(PYTEST_ARGS)

# Java, ZooKeeper and Redis (a JDK and Apache Curator for the tests that lock beside a Java holder,
# openssl for the TLS test's CA, chromium for the test that lays out the docs site in a browser) from
# the distribution, only when missing.
system:
	@missing=""; \
	command -v java >/dev/null 2>&1 || missing="$$missing default-jre-headless"; \
	[ -n "$$ZOOKEEPER_HOME" ] || [ -e /usr/share/java/zookeeper.jar ] || missing="$$missing zookeeper"; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v javac >/dev/null 2>&1 || missing="$$missing default-jdk-headless"; \
	ls /usr/share/java/curator-recipes*.jar >/dev/null 2>&1 || missing="$$missing libcurator-recipes-java"; \
	command -v openssl >/dev/null 2>&1 || missing="$$missing openssl"; \
	command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
	  || command -v google-chrome >/dev/null 2>&1 || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  echo "installing from the distribution:$$missing"; \
	  if ! command -v apt-get >/dev/null 2>&1; then \
	    echo "error: missing$$missing and there is no apt-get to install them; install them by hand (or set ZOOKEEPER_HOME)"; exit 1; fi; \
	  ( $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing ) >/tmp/celery-zklock-apt.log 2>&1 \
	    || { echo "error: could not install$$missing with apt-get (log: /tmp/celery-zklock-apt.log)"; exit 1; }; \
	fi

venv: $(STAMP)

# promtool checks deploy/prometheus/. It is taken out of Debian's prometheus package, not installed
# with it: the package starts a Prometheus server (:9090) and the node exporter it recommends (:9100)
# as services, now and at each boot. One on the PATH already is used as it is.
$(BIN)/promtool: | $(STAMP)
	@if command -v promtool >/dev/null 2>&1; then ln -sf "$$(command -v promtool)" $@; exit 0; fi; \
	tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; cd "$$tmp" && \
	{ apt-get download prometheus >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && apt-get download prometheus; } \
	  >/tmp/celery-zklock-apt.log 2>&1; } && dpkg-deb -x prometheus_*.deb unpacked && \
	cp unpacked/usr/bin/promtool "$(CURDIR)/$@" \
	|| { echo "error: could not take promtool out of Debian's prometheus package (log: /tmp/celery-zklock-apt.log)"; exit 1; }

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 9))' || { echo "error: $(PYTHON) is older than Python 3.9"; exit 1; }
	@[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV) || { echo "error: could not create a virtualenv with $(PYTHON) (install python3-venv)"; exit 1; }
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]' $(EDITABLE_MODE) --group lint --group ci
	@rm -f $(VENV)/.installed-*
	@touch $@

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info site
