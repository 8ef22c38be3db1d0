# Two commands do everything on a fresh machine: `make run` and `make test`.
# Both run `make setup` first; setup is idempotent and a no-op once done.

VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
RUNS ?= 5
# Two pytest workers: the e2e tests (real engines) in one lane, unit and integration tests
# beside them (tests/conftest.py, ENGINE_LANE; docs/testing.md). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
MODULE ?= tests/integration tests/e2e

.PHONY: help setup run test test-unit test-integration test-e2e flake-hunt lint format bench eagle3 clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'

setup:  ## create .venv, install the CPU or GPU extra, prepare the embedded model (idempotent)
	@VENV=$(VENV) scripts/setup.sh

run: setup  ## serve the embedded model with n-gram speculative decoding on :8000
	@PATH=$(CURDIR)/$(VENV)/bin:$$PATH launch/agg_spec_decoding.sh

test: setup  ## run the whole test suite (unit, integration with nats-server, e2e with vLLM)
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadgroup --module-durations 30 $(PYTEST_ARGS)

test-unit: setup  ## fast subset: pure logic only
	$(PY) -m pytest tests -m unit $(PYTEST_ARGS)

test-integration: setup  ## tests against a real nats-server (no engine)
	$(PY) -m pytest tests -m integration $(PYTEST_ARGS)

test-e2e: setup  ## tests with real vLLM engines on the embedded model
	$(PY) -m pytest tests -m e2e $(PYTEST_ARGS)

flake-hunt: setup  ## run each test module in MODULE (files or folders) RUNS times (5) with one core kept busy
	$(PY) scripts/flake_hunt.py --runs $(RUNS) $(MODULE)

lint: setup  ## ruff
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup  ## apply ruff formatting and safe fixes
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: setup  ## run every benchmark and print their ratios (QUICK=1: smoke run; docs/benchmarks.md)
	@PATH=$(CURDIR)/$(VENV)/bin:$$PATH benchmarks/run_all.sh

eagle3: setup  ## retrain the shipped Eagle3 head (~100 min on 2 cores; resumes from ~/.cache/dynamo/eagle3-work, delete it to start over; EAGLE3_ARGS adds flags)
	$(PY) -m dynamo.vllm.train_eagle3 --target smollm2-135m-instruct \
		--out lib/llm/src/dynamo/llm/models/heads/smollm2-135m-instruct-eagle3 \
		--work-dir $(HOME)/.cache/dynamo/eagle3-work $(EAGLE3_ARGS)
	$(PY) -m dynamo.llm.models prepare smollm2-135m-instruct-eagle3

clean:  ## remove the virtualenv and caches (the model cache in ~/.cache/dynamo stays)
	rm -rf $(VENV) .pytest_cache .ruff_cache
