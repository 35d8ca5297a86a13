# The two set-up commands: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# when make started, before it creates .venv: the demo's closing line says how long creating .venv took
MAKE_STARTED := $(shell date +%s)

.PHONY: demo test test-fast test-gpu test-lowest lint unit venv clean

venv: $(STAMP)

# Re-installs when pyproject.toml changes. torch/torchvision come from this machine's pip (lower bounds only).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	# LightningCLI's `fit --help` (and validate, test, predict), rendered once now: even the first call is then quick
	$(BIN)/python -c "from lightning_fastdata.cli import cache_help; cache_help()"
	touch $(STAMP)

demo: $(STAMP)
	MAKE_DEMO_STARTED=$(MAKE_STARTED) $(BIN)/python examples/demo.py

lint: $(STAMP)
	$(BIN)/ruff check lightning_fastdata tests examples fastdata_examples benchmarks
	$(BIN)/ruff format --check lightning_fastdata tests examples fastdata_examples benchmarks

# Two pytest processes, a test file each: most of the suite waits on subprocesses (DDP runs, killed-and-resumed
# runs, spawned readers). A module's fixtures stay in one process. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
unit: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile

test: lint unit

# While editing: everything but the tests marked `slow` (DDP and killed-and-resumed subprocess runs, spawned readers,
# conversions interrupted on purpose). CI (`make test`) runs them all.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not slow"

# On a GPU machine: only the tests marked `cuda` (skipped elsewhere), a short 16-mixed fit among them. Without a package
# registry, run `python -m pytest -m cuda` where the dependencies are installed.
test-gpu: $(STAMP)
	$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu needs a CUDA GPU')"
	$(BIN)/python -m pytest -m cuda

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info .demo

# The suite on the lowest versions pyproject.toml allows (constraints/lowest.txt), in .venv-lowest: what a user on
# the declared lower bounds runs. Not part of `make test` (it installs a second torch, about 3 GB).
test-lowest:
	test -x .venv-lowest/bin/python || $(PYTHON) -m venv .venv-lowest
	.venv-lowest/bin/python -m pip install --quiet --disable-pip-version-check -c constraints/lowest.txt -e '.[test]'
	.venv-lowest/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile
