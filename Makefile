# `make demo` and `make test` work on a fresh machine: they create .venv if missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-integrations lint bench clean

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
	$(VENV)/bin/ruff check funcgrad tests examples benchmarks
	$(VENV)/bin/ruff format --check funcgrad tests examples benchmarks
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q

# fg.Optimizer inside PyTorch Lightning and Hugging Face Trainer (tests/integrations):
# the `integrations` extra (versions pinned in constraints.txt) on top of the dev venv.
INTEGRATIONS := $(VENV)/.integrations

$(INTEGRATIONS): $(STAMP) constraints.txt
	$(PY) -m pip install -q -c constraints.txt -e ".[integrations]"
	touch $(INTEGRATIONS)

test-integrations: $(INTEGRATIONS)
	FUNCGRAD_INTEGRATIONS=1 $(PY) -m pytest -q tests/integrations

bench: $(STAMP)
	$(PY) benchmarks/bench_step.py
	$(PY) benchmarks/bench_per_sample.py
	$(PY) benchmarks/bench_compose.py
	$(PY) benchmarks/bench_dist.py
	$(PY) benchmarks/bench_longrun.py
	$(PY) benchmarks/bench_scaling.py
	$(PY) benchmarks/study_flat_state.py
	$(PY) benchmarks/bench_peers.py  # skipped unless: $(PY) -m pip install -e ".[bench]"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
