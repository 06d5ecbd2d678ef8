# Two entry points (see README): `make demo` and `make test`.
# Each creates .venv and installs the CPU build of torch 2.13.0 first, then rlmath
# with its extras, only when pyproject.toml changed since the last install.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlmath-installed

.PHONY: demo test test-triton lint typecheck bench bench-gpu peers

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,dev,demo]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rlmath demo $(ARGS)

# pytest exits 5 when it collected no test: that is a broken suite, not a pass.
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

# The Triton backend's kernels through Triton's interpreter, on CPU tensors, in
# their own environment (.venv-triton: the same torch, plus triton; a large wheel,
# so it is not in the `test` extra). The constraints file keeps torch at 2.13.0.
TRITON_VENV := .venv-triton
TRITON_STAMP := $(TRITON_VENV)/.rlmath-installed

$(TRITON_STAMP): pyproject.toml
	test -x $(TRITON_VENV)/bin/python || $(PYTHON) -m venv $(TRITON_VENV)
	echo "torch==2.13.0" > $(TRITON_VENV)/constraints.txt
	$(TRITON_VENV)/bin/python -m pip install -q torch==2.13.0
	$(TRITON_VENV)/bin/python -m pip install -q -c $(TRITON_VENV)/constraints.txt triton pytest 'hypothesis>=6.80' numpy
	$(TRITON_VENV)/bin/python -m pip install -q --no-deps -e '.[test,triton]'
	touch $(TRITON_STAMP)

test-triton: $(TRITON_STAMP)
	$(TRITON_VENV)/bin/python -c "import triton"  # the tests would skip without it
	TRITON_INTERPRET=1 $(TRITON_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		tests/engine/test_triton_backend.py tests/engine/test_backends.py; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy

bench: $(STAMP)
	for f in benchmarks/bench_*.py; do \
		[ "$$f" = benchmarks/bench_gpu.py ] || $(PY) $$f || exit 1; \
	done

bench-gpu: $(STAMP)
	$(PY) benchmarks/bench_gpu.py

# Differential tests against verl 0.9.1 and TRL 0.24, in their own environment.
peers:
	test -x .venv-peers/bin/python || bash tests/peers/setup_peers_env.sh
	.venv-peers/bin/python -m pytest -q -p no:cacheprovider tests/peers
