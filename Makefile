# The two set-up commands: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint unit venv clean

venv: $(STAMP)

# Re-installs when pyproject.toml changes. torch/torchvision come from this machine's pip (lower bounds only).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

lint: $(STAMP)
	$(BIN)/ruff check lightning_fastdata tests examples benchmarks
	$(BIN)/ruff format --check lightning_fastdata tests examples benchmarks

unit: $(STAMP)
	$(BIN)/python -m pytest

test: lint unit

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info .demo
