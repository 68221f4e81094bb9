# lbd developer entry points. Every target sets up what it needs itself (see README).
PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= dev
PY := $(VENV)/bin/python
DEV_STATE ?= .state/dev
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: setup setup-analytics java etcd prometheus run test test-unit test-fast lint proto bench bench-figures clean

setup: $(STAMP) etcd ## venv + install (idempotent), etcd-server via apt when missing

# One stamp per set of extras: .installed-dev, .installed-dev-analytics (dashes for commas).
$(VENV)/.installed-%: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is required")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(subst -,$(comma),$*)]'
	touch $@

# The tests and the linters cover the Spark pipeline too: they install the analytics extra and
# need Java for Spark. `make run` needs neither.
ANALYTICS_STAMP := $(VENV)/.installed-dev-analytics

setup-analytics: $(ANALYTICS_STAMP) etcd java ## setup plus the analytics extra (pyspark...)

java:
	@command -v java >/dev/null 2>&1 || { echo "Spark needs Java 17+: installing it with apt"; \
	sudo=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); $$sudo apt-get update -q && \
	$$sudo env DEBIAN_FRONTEND=noninteractive \
	apt-get install -y -q --no-install-recommends openjdk-17-jre-headless; }

etcd:
	@bash scripts/ensure-etcd.sh

# The monitoring tests check deploy/prometheus with promtool and run a real Prometheus.
prometheus:
	@command -v promtool >/dev/null 2>&1 || { echo "the monitoring tests need Prometheus: installing it with apt"; \
	sudo=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); $$sudo apt-get update -q && \
	$$sudo env DEBIAN_FRONTEND=noninteractive \
	apt-get install -y -q --no-install-recommends prometheus; }

run: setup ## the main job: a local 3-broker cluster with traffic, watched live until Ctrl-C
	@$(VENV)/bin/lbd dev up --brokers 3 --state-dir $(DEV_STATE) --traffic || exit $$?; \
	trap '$(VENV)/bin/lbd dev down --state-dir $(DEV_STATE)' EXIT; trap 'exit 130' INT TERM; \
	$(VENV)/bin/lbd ctl --server "$$($(VENV)/bin/lbd dev addr --state-dir $(DEV_STATE))" watch

# Two lanes of pytest side by side, one per core (scripts/run_tests.py): the tiers that keep a
# core busy (unit, contract, simulation, analytics, integration) at the lowest CPU priority, and
# the tiers that run dev clusters: end-to-end, both end-to-end and chaos on `lbd dev up --secure`
# clusters (mutual TLS, roles, etcd with TLS and auth), then chaos. Each run's log is printed
# whole when it ends, then a table of the time per run and per tier. JUNIT_DIR: where each run
# writes its JUnit report.
test: setup-analytics prometheus ## the whole suite, two lanes side by side, then the time per tier
	$(PY) scripts/run_tests.py $(if $(JUNIT_DIR),--junit-dir $(JUNIT_DIR))

test-unit: setup ## the pure, server-free tests only
	$(PY) -m pytest tests/unit

test-fast: setup ## the inner loop: unit and contract tests without the searches (about two minutes)
	$(PY) -m pytest tests/unit tests/contract -m "not slow"

lint: setup-analytics ## ruff, mypy (--strict on the core), import-linter layers, generated code up to date
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy lbd
	$(VENV)/bin/lint-imports
	$(PY) scripts/gen_protos.py --check

proto: setup ## regenerate lbd/gen from proto/ with the pinned grpcio-tools
	$(PY) scripts/gen_protos.py

bench: setup ## benchmarks of what exists: a table per suite, then the figures against baselines
	$(PY) -m bench

bench-figures: setup ## only the benchmarks with figures: each beside its baseline, as a ratio
	$(PY) -m bench --figures

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .import_linter_cache
