"""vLLM 0.33.0's own KV ledger, driven like pdserve's for a side-by-side benchmark.

vLLM is never a dependency of pdserve: `make bench-vllm-env` installs the vllm wheel
(`--no-deps`) plus the few packages its `v1.core.kv_cache_manager`, `v1.request` and
`sampling_params` modules import, pinned, into `build/vllm-bench-env`. Only this module
puts that folder on `sys.path`, for the imports, and takes it off again:

```
build/vllm-bench-env/   vllm 0.33.0 + its import-time packages (no torch: the project's CPU torch serves)
bench/vllm_ledger.py    load_vllm() -> VLLMDriver factory, or the reason it is unavailable
```

vLLM hashes blocks with its `xxhash` option (xxh3_128 over a pickle), the closest to
pdserve's xxh3_128; its default sha256 would only make vLLM look slower.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ledger_trace import TraceRequest, TraceShape

VLLM_VERSION = "0.33.0"
DEFAULT_VLLM_ENV = Path(__file__).resolve().parent.parent / "build" / "vllm-bench-env"


def load_vllm(env_dir: Path = DEFAULT_VLLM_ENV) -> tuple[Callable[[TraceShape], Any] | None, str]:
    """(a factory of vLLM drivers, "vllm 0.33.0") or (None, why vLLM is not available)."""
    if not env_dir.is_dir():
        return None, f"vLLM is not installed (no {env_dir}); run `make bench-vllm-env`"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    sys.path.insert(0, str(env_dir))
    try:
        import torch
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import xxhash
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request
    except ImportError as error:
        return None, f"vLLM in {env_dir} does not import: {error}"
    finally:
        sys.path.remove(str(env_dir))
    if vllm.__version__ != VLLM_VERSION:
        return (
            None,
            f"{env_dir} holds vllm {vllm.__version__}, the benchmark compares against {VLLM_VERSION}",
        )
    logging.getLogger("vllm").setLevel(logging.ERROR)
    init_none_hash(xxhash)

    class VLLMDriver:
        """vLLM's `KVCacheManager` over one full-attention group, requests with its hasher."""

        name = f"vLLM {VLLM_VERSION}"

        def __init__(self, shape: TraceShape) -> None:
            spec = FullAttentionSpec(
                block_size=shape.block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
            )
            config = KVCacheConfig(
                num_blocks=shape.num_blocks,
                kv_cache_tensors=[],
                kv_cache_groups=[KVCacheGroupSpec(["layers.0"], spec)],
            )
            self.manager = KVCacheManager(
                config,
                max_model_len=shape.max_model_len,
                scheduler_block_size=shape.block_size,
                hash_block_size=shape.block_size,
                enable_caching=True,
                log_stats=True,
            )
            self._hasher = get_request_block_hasher(shape.block_size, xxhash)
            self._params = SamplingParams(max_tokens=shape.max_model_len)

        def new_request(self, trace_request: TraceRequest) -> Any:
            return Request(
                trace_request.request_id,
                list(trace_request.prompt_token_ids),
                self._params,
                None,
                block_hasher=self._hasher,
            )

        append_token = staticmethod(Request.append_output_token_ids)

        def get_computed_blocks(self, request: Any) -> tuple[Any, int]:
            blocks, num_hit_tokens, _ = self.manager.get_computed_blocks(request)
            return blocks, num_hit_tokens

    return VLLMDriver, f"vllm {vllm.__version__}"
