# Development entry points. `make test` is the test command CI runs (see .ci/run).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
CORE   := setup.py $(wildcard transportd/core/*.c transportd/core/*.h) $(wildcard cmd_ring/include/transportd/*.h) \
          $(wildcard ib/csrc/*.c ib/csrc/*.h efa/csrc/*.c efa/csrc/*.h softverbs/csrc/*.c)

.PHONY: venv test demo lint core fuzz-validate pyverbs-bridge asan-test
venv: $(VENV)/.installed
# a new top-level package (a new */__init__.py) re-installs too: the editable install maps packages by name
$(VENV)/.installed: pyproject.toml $(wildcard */__init__.py)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 'setuptools>=77'
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
	    -I cmd_ring/include -o build/fuzz_validate transportd/core/fuzz_validate.c
	build/fuzz_validate -max_total_time=$${FUZZ_SECONDS:-60} -print_final_stats=1

# The compiled data path (transportd._core: the core and the backends' C, ib/csrc and efa/csrc) under
# AddressSanitizer + UndefinedBehaviorSanitizer: a copy of the tree (build/asan-tree) built with both, its
# data-path tests run with the runtimes preloaded into Python. Leak checking is off:
# CPython's own allocations at exit would drown any report. The bridge's test is left out: the copy holds
# no built bridge, and the bridge is Cython, not this C. CI runs it after `make test`.
SANITIZE   := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -O1 -g
ASAN_TESTS ?= tests/transportd/dataplane/test_core_differential.py tests/transportd/dataplane/test_proxy.py \
              tests/transportd/dataplane/test_serve_loop.py tests/transportd/dataplane/test_gpu_direct_copier.py \
              tests/ib tests/efa
asan-test: venv
	rm -rf build/asan-tree && mkdir -p build/asan-tree
	git ls-files -z --cached --others --exclude-standard \
	    | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C build/asan-tree
	cd build/asan-tree && CFLAGS="$(SANITIZE)" LDFLAGS="-fsanitize=address,undefined" \
	    $(abspath $(PY)) setup.py -q build_ext --inplace --force
	# --capture=sys: a report is written to fd 2 and the process aborts; pytest's fd capture would swallow it
	cd build/asan-tree && LD_PRELOAD="$$($${CC:-cc} -print-file-name=libasan.so) $$($${CC:-cc} -print-file-name=libubsan.so)" \
	    ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 PYTHONPATH="$$PWD$${PYTHONPATH:+:$$PYTHONPATH}" \
	    $(abspath $(PY)) -m pytest -q -p no:cacheprovider --capture=sys $(ASAN_TESTS) \
	    --ignore=tests/ib/test_pyverbs_bridge.py

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
