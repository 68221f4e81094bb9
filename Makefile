# lbd developer entry points. Every target sets up what it needs itself (see README).
PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= dev
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
comma := ,

.PHONY: setup etcd run test test-unit lint proto bench clean

setup: $(STAMP) etcd ## venv + install (idempotent), etcd-server via apt when missing

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is required")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

etcd:
	@bash scripts/ensure-etcd.sh

run: setup ## the main job: until the sidecar exists, a live dry run of the core
	$(VENV)/bin/lbd demo

test: setup ## the whole suite, real etcd and pulsar-lite included
	$(PY) -m pytest

test-unit: setup ## the pure, server-free tests only
	$(PY) -m pytest tests/unit

lint: setup ## ruff, mypy (--strict on the core), import-linter layers, generated code up to date
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy lbd
	$(VENV)/bin/lint-imports
	$(PY) scripts/gen_protos.py --check

proto: setup ## regenerate lbd/gen from proto/ with the pinned grpcio-tools
	$(PY) scripts/gen_protos.py

bench: setup ## benchmarks of what exists, printed as a table
	$(PY) -m bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .import_linter_cache
