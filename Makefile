# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create or reuse .venv. torch is installed first, pinned, so that installing pipeload
# (which asks only for torch>=2.4) never pulls a different torch build.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: demo test test-all bench clean

$(VENV)/.installed: pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[test,bench]'
	@touch $@

demo: $(VENV)/.installed
	$(PY) -m pipeload bench

test: $(VENV)/.installed
	$(PY) -m pytest -q

test-all: $(VENV)/.installed
	$(PY) -m pytest -q -m ''

bench: $(VENV)/.installed
	$(PY) -m bench.run

clean:
	rm -rf $(VENV) build src/*.egg-info
