# The two commands of the README:  `make run`  and  `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# torch is pinned: 2.13.0 is a CPU build from local disk; an unpinned torch pulls CUDA.
TORCH   := torch==2.13.0

.PHONY: run test lint install services clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)" -e '.[dev,torch]'
	touch $(STAMP)

install: $(STAMP)

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
## Prometheus, Chromium) and end-to-end
test: $(STAMP) services lint
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) var build *.egg-info .pytest_cache .mypy_cache .ruff_cache
