# Development entry points. `make test` is the test command CI runs (see .ci/run).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: venv test demo lint
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

lint: venv
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -m "not gpu and not hardware" $(PYTEST_ARGS)

demo: venv
	$(VENV)/bin/transportd demo
