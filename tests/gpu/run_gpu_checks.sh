#!/usr/bin/env bash
# Runs every CUDA test of pdserve on a GPU machine, in one go, and says what it ran on; then
# the decode-step benchmark (eager, static buffers, CUDA graphs; the floor; transformers'
# static cache) and the MoE one (its decode step in a graph against the dense model), each
# bounded by BENCH_TIMEOUT_S (default 240 s; 0 skips them).
# Usage (repository root, a Python with CUDA torch; `make gpu-wheels` here first, and carry
# build/gpu-wheels to the GPU machine with the tree):
#   tests/gpu/run_gpu_checks.sh [python] [pytest arguments]
# Exit status: pytest's; 3 when this Python has no CUDA (nothing would be checked).
set -euo pipefail
PYTHON="${1:-python}"
cd "$(dirname "$0")/../.."
# pdserve (this tree, as a package) and the wheels `make gpu-wheels` put in build/gpu-wheels,
# unpacked (no registry, and no install step that checks the image's platform tags).
mkdir -p .pypath && ln -sfn .. .pypath/pdserve
for wheel in build/gpu-wheels/*.whl; do
    [ -e "$wheel" ] && "$PYTHON" -m zipfile -e "$wheel" .pypath
done
export PYTHONPATH="$PWD/.pypath:$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
"$PYTHON" - <<'PY' || exit 3
import sys, torch
print(f"torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"available {torch.cuda.is_available()}", flush=True)
if torch.cuda.is_available():
    print(f"device 0: {torch.cuda.get_device_name(0)}")
sys.exit(0 if torch.cuda.is_available() else 1)
PY
# --noconftest: the suite's root conftest configures Ray, which a GPU image need not have; the
# GPU tests use no fixture of it.
status=0
"$PYTHON" -m pytest -q -rs -s --noconftest tests/gpu "${@:2}" || status=$?
if [ "${BENCH_TIMEOUT_S:-240}" != 0 ]; then
    for bench in "bench_decode_step.py --device cuda" "bench_moe.py --device cuda"; do
        (cd bench && timeout "${BENCH_TIMEOUT_S:-240}" "$PYTHON" $bench) \
            || echo "$bench ended with status $?" >&2
    done
fi
exit "$status"
