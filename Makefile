# jaxpod: `make demo` and `make test` set everything up on a fresh machine by themselves.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= configs/demo.yaml
# Each demo run gets its own record (an existing logdir would resume instead).
DEMO_LOGDIR ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)
LOGDIR ?= runs
TB_HOST ?= 127.0.0.1
TB_PORT ?= 6006
# pytest-xdist workers. Each test module is one unit of work (its module fixtures are built
# once) unless it splits itself with `xdist_group` marks; tests/conftest.py hands the units
# out heaviest first (--no-loadscope-reorder keeps that order) and gives every process of the
# session, CLI subprocesses included, one shared jax compilation cache.
TEST_WORKERS ?= 2
PYTEST_XDIST := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

.PHONY: demo test test-fast lint format lock tensorboard profile runs bench notebooks figures clean

# The virtualenv: uv installs the packages (and byte-compiles them) in a third of pip's time;
# pip does it if uv cannot. constraints.txt holds the versions the suite is tested with
# (pyproject.toml gives the ranges a user's install may take; `make lock` re-resolves them).
# XLA:GPU's compiler (pyproject's `gpu-target` extra, for `jaxpod compile --target h100:N`)
# goes to $(VENV)/gpu-target, off jax's plugin path: where no GPU is, a CUDA plugin jax finds
# at start-up logs warnings (jaxpod/target/gpu.py).
UV := uv==0.13.9
LOCK := constraints.txt
GPU_COMPILER := jax-cuda12-plugin jax-cuda12-pjrt
$(BIN)/uv:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(UV)

$(STAMP): pyproject.toml $(LOCK) | $(BIN)/uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python --compile-bytecode -c $(LOCK) -e ".[dev]" \
		|| $(BIN)/pip install --quiet -c $(LOCK) -e ".[dev]"
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps -c $(LOCK) \
		--target $(VENV)/gpu-target $(GPU_COMPILER) || $(BIN)/pip install --quiet --no-deps \
		-c $(LOCK) --target $(VENV)/gpu-target $(GPU_COMPILER)
	touch $(STAMP)

# Re-resolve $(LOCK) after a change of pyproject.toml's dependencies: the versions already
# locked are kept where they still fit (LOCK_FLAGS=--upgrade takes the newest); then `make test`.
lock: | $(BIN)/uv
	$(BIN)/uv pip compile pyproject.toml --extra dev --extra gpu-target --python $(BIN)/python \
		--annotation-style line --custom-compile-command "make lock" $(LOCK_FLAGS) -o $(LOCK)

demo: $(STAMP)
	$(BIN)/jaxpod train $(CONFIG) train.logdir=$(DEMO_LOGDIR)

# Everything (what CI runs).
test: $(STAMP)
	$(BIN)/pytest -q $(PYTEST_XDIST)

# The edit loop: no CLI subprocesses, full-size compiles, notebooks, long training runs or
# whole-train-step engine compiles (the `slow` kinds, tests/conftest.py).
test-fast: $(STAMP)
	$(BIN)/pytest -q $(PYTEST_XDIST) -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

tensorboard: $(STAMP)
	$(BIN)/jaxpod tensorboard $(LOGDIR) --host $(TB_HOST) --port $(TB_PORT)

# Warm up, then trace a few steps of CONFIG into <its logdir>-profile (PROFILE tab).
profile: $(STAMP)
	$(BIN)/jaxpod profile $(CONFIG)

runs: $(STAMP)
	$(BIN)/jaxpod runs $(LOGDIR)

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_core.py

# The notebooks' sources are notebooks/NN_*.py (jupytext percent format); this writes each
# paired .ipynb, executed, outputs included (a few minutes).
NOTEBOOKS := $(wildcard notebooks/[0-9][0-9]_*.py)
notebooks: $(STAMP)
	$(BIN)/jupytext --to ipynb --update $(NOTEBOOKS)
	$(BIN)/jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.record_timing=False $(NOTEBOOKS:.py=.ipynb)

# docs/figures/*.png from jaxpod and the committed data in docs/figures/data/ (a minute);
# `$(BIN)/python -m jaxpod.figures --refresh compiled,compiled-tpu,meshes,digits` recomputes it.
figures: $(STAMP)
	$(BIN)/python -m jaxpod.figures

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
