# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create or reuse .venv and say what they install, step by step (pip shows its progress:
# torch is the large download). torch is installed first, pinned, so that installing pipeload
# (which asks only for torch>=2.4) never pulls a different torch build. The demo installs only
# what it runs (pipeload and its `bench` extra); the test extras come with `make test`.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check
TORCH_VERSION ?= 2.13.0
BENCH_EXTRA := tqdm, Pillow, psutil, matplotlib
TEST_EXTRA := pytest, pytest-timeout, Lightning, accelerate, fsspec, aiohttp, s3fs, moto[server], zstandard, Ray

.PHONY: demo test test-all bench clean

$(VENV)/.torch:
	@echo "== step 1: a virtual environment in $(VENV) (reused if there)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	@echo "== step 2: torch $(TORCH_VERSION), pinned (the large download: ~200 MB for the CPU build, several GB for a CUDA one)"
	$(PIP) torch==$(TORCH_VERSION)
	@touch $@

# One stamp per target: the demo's install does not stand for the tests' (and the reverse).
$(VENV)/.demo: $(VENV)/.torch pyproject.toml Makefile
	@echo "== step 3: pipeload (editable, with numpy) and the demo's extra: $(BENCH_EXTRA)"
	$(PIP) -e '.[bench]'
	@touch $@

$(VENV)/.test: $(VENV)/.torch pyproject.toml Makefile
	@echo "== step 3: pipeload (editable, with numpy) and the test extras: $(TEST_EXTRA), and their dependencies (~100 packages)"
	$(PIP) -e '.[test,bench]'
	@touch $@

demo: $(VENV)/.demo
	@echo "== step 4: python -m pipeload bench: torch's DataLoader and each of pipeload's modes on small JPEGs"
	$(PY) -m pipeload bench

# The tests start many interpreters (spawned workers, CLI runs, torchrun jobs, Ray actors), each
# importing pipeload: its bytecode is compiled once here, as none of them keeps what it compiles
# where PYTHONDONTWRITEBYTECODE is set (a clean clone in CI: ~14% off the spawn-heavy tests).
test: $(VENV)/.test
	@$(PY) -m compileall -q -j 0 src tests examples bench > /dev/null
	$(PY) -m pytest -q

test-all: $(VENV)/.test
	@$(PY) -m compileall -q -j 0 src tests examples bench > /dev/null
	$(PY) -m pytest -q -m ''

bench: $(VENV)/.demo
	$(PY) -m bench.run

clean:
	rm -rf $(VENV) build src/*.egg-info
