# `make demo` and `make test` work on a fresh machine: they create .venv if missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-other-cpu test-newest test-integrations docs lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch is pinned to the 2.13.0 CPU build for development and CI (constraints.txt);
	# pyproject.toml states the supported range.
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,examples]"
	touch $(STAMP)

# torch.compile's on-disk caches (FX graph + AOTAutograd, on by default in torch 2.13)
# kept beside the venv, so they survive a reboot: the demo's second run starts warm.
COMPILE_CACHE ?= $(abspath $(VENV))/compile-cache

demo: $(STAMP)
	TORCHINDUCTOR_CACHE_DIR=$(COMPILE_CACHE) $(PY) examples/binarized_digits.py

lint: $(STAMP)
	$(VENV)/bin/ruff check funcgrad tests examples benchmarks tools
	$(VENV)/bin/ruff format --check funcgrad tests examples benchmarks tools
	$(VENV)/bin/mypy

# Prints the 15 slowest tests and the wall time (about 14 min on 2 cores).
test: lint
	@start=$$(date +%s); $(PY) -m pytest -q --durations=15; rc=$$?; \
	echo "make test: pytest took $$(( $$(date +%s) - start )) s"; exit $$rc

# The rounding-sensitive part of the suite (the examples' tests, the fixture tests, the
# tests that compare floats with zero tolerance against torch.optim) again on other kernel paths: MKL's
# portable code path and torch's AVX2 kernels (docs/testing.md, "On another CPU"). Its
# own inductor cache: torch's cache does not tell kernels built for one
# ATEN_CPU_CAPABILITY from another's, and a process reading the other's kernels
# corrupts its heap (docs/compile-notes.md, "Torch bugs, with their repros").
OTHER_CPU_TESTS := tests/test_examples.py tests/test_checkpoint.py tests/test_adam.py \
	tests/test_rules.py tests/test_optimizer_class.py tests/test_low_precision.py \
	tests/test_optimizers_everywhere.py tests/test_lr_state.py tests/test_optim_db.py \
	tests/test_flat.py::test_checkpoint_written_before_the_flat_layout_loads_and_resumes
OTHER_CPU ?= MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=avx2

test-other-cpu: $(STAMP)
	@start=$$(date +%s); $(OTHER_CPU) TORCHINDUCTOR_CACHE_DIR=$(abspath $(VENV))/inductor-cache-other-cpu \
		$(PY) -m pytest -q $(OTHER_CPU_TESTS); rc=$$?; \
	echo "make test-other-cpu ($(OTHER_CPU)): pytest took $$(( $$(date +%s) - start )) s"; exit $$rc

# The quick part for the edit loop (under a minute on 2 cores): the eager reference
# tests of rules, groups, transformations and Adam; a test skips where it would call
# torch.compile (tests/conftest.py).
FAST_TESTS := tests/test_groups.py tests/test_rules.py tests/test_transforms.py tests/test_adam.py

test-fast: $(STAMP)
	@start=$$(date +%s); FUNCGRAD_FAST=1 $(PY) -m pytest -q -x $(FAST_TESTS); \
	rc=$$?; echo "make test-fast: $$(( $$(date +%s) - start )) s"; exit $$rc

# fg.Optimizer inside PyTorch Lightning and Hugging Face Trainer (tests/integrations):
# the `integrations` extra (versions pinned in constraints.txt) on top of the dev venv.
INTEGRATIONS := $(VENV)/.integrations

$(INTEGRATIONS): $(STAMP) constraints.txt
	$(PY) -m pip install -q -c constraints.txt -e ".[integrations]"
	touch $(INTEGRATIONS)

test-integrations: $(INTEGRATIONS)
	FUNCGRAD_INTEGRATIONS=1 $(PY) -m pytest -q tests/integrations

# The newest torch pip installs here (README: tested range). One edit when a release
# lands: TORCH_NEWEST. Its own venv, the same suite; the default wheel is the multi-GB
# CUDA build, which runs on the CPU.
TORCH_NEWEST ?= 2.14.1
VENV_NEWEST ?= .venv-newest
NEWEST := $(VENV_NEWEST)/.installed-$(TORCH_NEWEST)

$(NEWEST): pyproject.toml constraints.txt
	test -x $(VENV_NEWEST)/bin/python || $(PYTHON) -m venv $(VENV_NEWEST)
	grep -v '^torch==' constraints.txt > $(VENV_NEWEST)/constraints.txt
	$(VENV_NEWEST)/bin/python -m pip install -q torch==$(TORCH_NEWEST)
	$(VENV_NEWEST)/bin/python -m pip install -q -c $(VENV_NEWEST)/constraints.txt -e ".[dev,examples]"
	# timm and torchvision (tests/test_vision_ghost.py; it skips where they are absent)
	$(VENV_NEWEST)/bin/python -m pip install -q -c $(VENV_NEWEST)/constraints.txt torchvision timm
	touch $(NEWEST)

test-newest: $(NEWEST)
	$(VENV_NEWEST)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(VENV_NEWEST)/bin/python -m pytest -q $(NEWEST_TESTS)

# The API site: the docs/ pages as its guide, the reference from the docstrings;
# --strict fails on a broken link or a missing reference. Home is README.md.
DOCS := $(VENV)/.docs

$(DOCS): $(STAMP) constraints.txt
	$(PY) -m pip install -q -c constraints.txt -e ".[docs]"
	touch $(DOCS)

docs: $(DOCS)
	sed -e 's#](docs/#](#g' -e 's#\[benchmarks/README.md\](benchmarks/README.md)#`benchmarks/README.md`#' \
		README.md > docs/index.md
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	@echo "site: build/site/index.html"

bench: $(STAMP)
	$(PY) benchmarks/bench_step.py
	$(PY) benchmarks/bench_step.py --part layout-eager
	$(PY) benchmarks/bench_step.py --part layout-compiled
	$(PY) benchmarks/bench_step.py --part layout-update
	$(PY) benchmarks/bench_per_sample.py
	$(PY) benchmarks/bench_per_sample.py --part rule
	$(PY) benchmarks/bench_compose.py
	$(PY) benchmarks/bench_optimizers.py
	$(PY) benchmarks/bench_dist.py
	$(PY) benchmarks/bench_async.py
	$(PY) benchmarks/bench_scaling.py
	$(PY) benchmarks/bench_compile_cpu.py
	$(PY) benchmarks/bench_drop_in.py
	$(PY) benchmarks/bench_peers.py  # skipped unless: $(PY) -m pip install -e ".[bench]"

clean:
	rm -rf $(VENV) $(VENV_NEWEST) .pytest_cache .ruff_cache .hypothesis
