# The two commands of the README:  `make run`  and  `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# torch is pinned: 2.13.0 is a CPU build from local disk; an unpinned torch pulls CUDA.
TORCH   := torch==2.13.0

.PHONY: run test lint install services clean verl-venv test-verl

# verl pins an older transformers than TRL: its plugin is tested in a venv of its own
VERL_VENV := .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed

$(STAMP): pyproject.toml setup.py service/domain/_partial.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)" -e '.[dev,torch]'
	touch $(STAMP)

install: $(STAMP)

$(VERL_STAMP): pyproject.toml
	test -x $(VERL_VENV)/bin/python || $(PY) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q --upgrade pip
	$(VERL_VENV)/bin/python -m pip install -q "$(TORCH)" TransferQueue cachetools -e '.[verl,service]' \
		pytest pytest-timeout
	touch $(VERL_STAMP)

verl-venv: $(VERL_STAMP)

## test-verl: the verl plugin against verl itself (its own venv)
test-verl: $(VERL_STAMP) services
	$(VERL_VENV)/bin/python -m pytest -p no:cacheprovider tests/verl_plugin

## run: the service on its embedded default (SQLite, in-process state) and a demo run
run: $(STAMP)
	$(BIN)/steptally demo --serve

services:
	bash scripts/ensure-services.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	PATH="$(CURDIR)/$(BIN):$$PATH" bash .ci/mypy

## test: the whole suite — lint, types, unit, integration (real PostgreSQL, Redis,
## Prometheus, Chromium), end-to-end, and the verl plugin against verl in its own venv
test: $(STAMP) services lint
	$(BIN)/python -m pytest
	$(MAKE) test-verl

clean:
	rm -rf $(VENV) $(VERL_VENV) var build *.egg-info .pytest_cache .mypy_cache .ruff_cache
