# Development entry points. `make test` is the test command CI runs (see .ci/run).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
CORE   := setup.py $(wildcard transportd/core/*.c transportd/core/*.h) cmd_ring/include/transportd/cmd_ring.h

.PHONY: venv test demo lint core fuzz-validate pyverbs-bridge
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

# The pyverbs bridge (transportd/core/_pyverbs_bridge.pyx): reads the ibv_qp_ex / ibv_cq_ex behind pyverbs'
# QPEx and CQEX, so the compiled data path posts to a real NIC. Built against the rdma-core source tree
# whose pyverbs this Python imports (its .pxd files and headers); softverbs needs none of it.
RDMA_CORE_TREE ?= $(TRANSPORTD_RDMA_CORE_TREE)
pyverbs-bridge: venv
	@test -d "$(RDMA_CORE_TREE)/pyverbs" || { echo "pyverbs-bridge: set RDMA_CORE_TREE to the rdma-core tree pyverbs was built from"; exit 2; }
	$(PY) -m pip install -q 'cython>=0.29,<3.1'
	mkdir -p build
	$(PY) -m cython -3 --module-name transportd._pyverbs_bridge -I "$(RDMA_CORE_TREE)" \
	    -o build/_pyverbs_bridge.c transportd/core/_pyverbs_bridge.pyx
	$${CC:-cc} -shared -fPIC -O2 -I"$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
	    -I"$(RDMA_CORE_TREE)/build/include" build/_pyverbs_bridge.c \
	    -o "transportd/_pyverbs_bridge$$($(PY) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
