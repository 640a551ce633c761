"""The GPU suite: every test here needs CUDA; each module skips itself, saying so, without it
(``pytestmark``). Run them all on a GPU machine with ``tests/gpu/run_gpu_checks.sh``."""
