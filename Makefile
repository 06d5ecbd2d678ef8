# Two entry points (see README): `make demo` and `make test`.
# Each creates .venv and installs torch 2.13.0 first, then rlmath with its extras,
# only when pyproject.toml changed since the last install.
#
# TORCH_INDEX_URL: the package index torch is installed from. Empty (the default):
# a plain `pip install torch==2.13.0` from the index pip is configured with. Where
# that index serves only CUDA builds, take the CPU build from PyTorch's index:
#   make test TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# It is used when .venv is set up; remove .venv to switch builds.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlmath-installed
TORCH_INDEX_URL ?=
TORCH_PIP_ARGS := $(if $(strip $(TORCH_INDEX_URL)),--index-url $(TORCH_INDEX_URL))

# The documentation site and the source distribution use their own environment.
DOCS_VENV ?= .venv-docs
DOCS_PY := $(DOCS_VENV)/bin/python
DOCS_STAMP := $(DOCS_VENV)/.rlmath-docs-installed

.PHONY: demo test test-integration test-all test-triton test-gpu-compile test-gpu-compile-oldest lint typecheck bench bench-gpu peers docs sdist test-torch-oldest

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(PY) -m pip install -q -e '.[test,dev,demo,hf]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rlmath demo $(ARGS)

# pytest exits 5 when it collected no test: that is a broken suite, not a pass.
# Two tiers (docs/development.md): `make test` runs the fast one, every test not
# marked `integration`; `make test-integration` the tests that start processes
# (gloo ranks, torchrun, subprocesses) or compile; `make test-all` both. CI runs
# `make test` and `make test-integration`.
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
NO_TESTS = if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

test: $(STAMP)
	$(PYTEST) -m "not integration" tests; rc=$$?; $(NO_TESTS)

test-integration: $(STAMP)
	$(PYTEST) -m integration tests; rc=$$?; $(NO_TESTS)

test-all: $(STAMP)
	$(PYTEST) tests; rc=$$?; $(NO_TESTS)

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

# The Triton kernels compiled for NVIDIA GPUs on this CPU-only machine, through the
# real launch code (tests/engine/triton_gpu_check.py): every specialization the
# wrappers produce, for sm_90 and sm_80 on the newest triton (test-gpu-compile, in
# CI) and for sm_90 on the oldest one rlmath supports (test-gpu-compile-oldest:
# triton 3.4 in its own environment, sm_80 too with OLDEST_ARCHS="90 80"; left out
# of CI for time, about 3 minutes more). Fails on a compile error, a register
# spill, or a row stream that is not read 128 bits at a time on an aligned layout;
# prints registers, shared memory, occupancy and access widths. Compiled kernels
# and their figures are cached in each environment.
TRITON_OLDEST ?= 3.4.0
OLDEST_ARCHS ?= 90
TRITON_OLDEST_VENV := .venv-triton-oldest
TRITON_OLDEST_STAMP := $(TRITON_OLDEST_VENV)/.rlmath-installed

$(TRITON_OLDEST_STAMP): pyproject.toml
	test -x $(TRITON_OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(TRITON_OLDEST_VENV)
	echo "torch==2.13.0" > $(TRITON_OLDEST_VENV)/constraints.txt
	$(TRITON_OLDEST_VENV)/bin/python -m pip install -q torch==2.13.0
	$(TRITON_OLDEST_VENV)/bin/python -m pip install -q -c $(TRITON_OLDEST_VENV)/constraints.txt \
		triton==$(TRITON_OLDEST) 'numpy<2.4'
	$(TRITON_OLDEST_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(TRITON_OLDEST_STAMP)

test-gpu-compile: $(TRITON_STAMP)
	$(TRITON_VENV)/bin/python -m tests.engine.triton_gpu_check --jobs 2 --arch 90 80 \
		--cache $(TRITON_VENV)/gpu-check-cache

test-gpu-compile-oldest: $(TRITON_OLDEST_STAMP)
	$(TRITON_OLDEST_VENV)/bin/python -m tests.engine.triton_gpu_check --jobs 2 \
		--arch $(OLDEST_ARCHS) --cache $(TRITON_OLDEST_VENV)/gpu-check-cache

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples docs/_ext
	$(VENV)/bin/ruff format --check src tests benchmarks examples docs/_ext

typecheck: $(STAMP)
	$(VENV)/bin/mypy

bench: $(STAMP)
	for f in benchmarks/bench_*.py; do \
		[ "$$f" = benchmarks/bench_gpu.py ] || $(PY) $$f || exit 1; \
	done

bench-gpu: $(STAMP)
	$(PY) benchmarks/bench_gpu.py

# The whole suite on the oldest torch rlmath supports (pyproject: torch>=2.6), in its
# own environment. Not in CI: the torch wheel and its CUDA libraries take ~5 GB, and
# the suite on a CPU-only build of 2.6 is as long as the main one.
TORCH_OLDEST ?= 2.6.0
OLDEST_VENV ?= .venv-torch-oldest
test-torch-oldest:
	test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q torch==$(TORCH_OLDEST) $(TORCH_PIP_ARGS)
	echo "torch==$(TORCH_OLDEST)" > $(OLDEST_VENV)/constraints.txt
	$(OLDEST_VENV)/bin/python -m pip install -q -c $(OLDEST_VENV)/constraints.txt -e '.[test,demo,hf]'
	$(OLDEST_VENV)/bin/python -c "import torch; assert torch.__version__.startswith('$(TORCH_OLDEST)')"
	$(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider tests

# Differential tests against verl 0.9.1 and TRL 0.24, in their own environment, then
# the TRL tests against the newest TRL tested, in a second one (every peer version
# is pinned in tests/peers/constraints.txt).
peers:
	test -x .venv-peers/bin/python || bash tests/peers/setup_peers_env.sh
	.venv-peers/bin/python -m pytest -q -p no:cacheprovider tests/peers
	test -x .venv-peers-trl-new/bin/python || PEERS=trl-new bash tests/peers/setup_peers_env.sh
	.venv-peers-trl-new/bin/python -m pytest -q -p no:cacheprovider \
		tests/peers/test_compat_trl.py tests/peers/test_compat_trl_install.py

$(DOCS_STAMP): docs/requirements.txt
	test -x $(DOCS_PY) || $(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_PY) -m pip install -q -r docs/requirements.txt
	touch $(DOCS_STAMP)

# The HTML site (guides + API reference from the docstrings) into site/; any
# warning fails the build (mkdocs.yml: strict), and so does a Returns section
# that the site's docstring parser would split into several rows
# (docs/_ext/check_returns.py).
docs: $(DOCS_STAMP)
	$(DOCS_PY) docs/_ext/check_returns.py
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict --site-dir site

# The source distribution into dist/, then a check that it carries every tracked
# file of the library, the tests, the docs, the examples and the benchmarks.
sdist: $(DOCS_STAMP)
	rm -f dist/rlmath-*.tar.gz
	$(DOCS_PY) -m build --sdist --outdir dist .
	tar -tzf dist/rlmath-*.tar.gz | sed 's|^[^/]*/||' | sort > dist/sdist-files.txt
	git ls-files src tests docs examples benchmarks Makefile pyproject.toml LICENSE \
		README.md CHANGELOG.md CONTRIBUTING.md mkdocs.yml MANIFEST.in | sort \
		| comm -23 - dist/sdist-files.txt > dist/sdist-missing.txt
	@if [ -s dist/sdist-missing.txt ]; then \
		echo "missing from the sdist:"; cat dist/sdist-missing.txt; exit 1; fi
	@echo "sdist: $$(ls dist/rlmath-*.tar.gz), $$(wc -l < dist/sdist-files.txt) entries, tests included"
