# Development entry points. `make test` is the test command CI runs (see .ci/run).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
CORE   := setup.py $(wildcard transportd/core/*.c transportd/core/*.h) cmd_ring/include/transportd/cmd_ring.h

.PHONY: venv test demo lint core fuzz-validate
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 'setuptools>=68'
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# The compiled data path (transportd._core), rebuilt in place whenever its sources change.
core: $(VENV)/.core
$(VENV)/.core: $(VENV)/.installed $(CORE)
	$(PY) setup.py -q build_ext --inplace
	touch $@

lint: venv
	$(VENV)/bin/ruff check .

test: lint core
	$(PY) -m pytest -m "not gpu and not hardware" $(PYTEST_ARGS)

demo: venv core
	$(VENV)/bin/transportd demo

# libFuzzer + AddressSanitizer/UBSan over the record validation (transportd/core/validate.h).
fuzz-validate:
	mkdir -p build && $${CC_FUZZ:-clang-14} -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
	    -o build/fuzz_validate transportd/core/fuzz_validate.c
	build/fuzz_validate -max_total_time=$${FUZZ_SECONDS:-60} -print_final_stats=1
