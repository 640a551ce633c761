"""KV bytes moved per prompt token, and the hand-off's time, for latent attention (MLA) against
grouped-query and multi-head attention of the same width, side by side in one process.

Three random models saved by transformers and loaded by ``LLMEngine.from_pretrained``, each
``hidden 1024, 16 query heads of 64, 8 layers``:

    mha        Llama, 16 KV heads                 caches 2 x 16 x 64 = 2048 values / token / layer
    gqa        Llama, 4 KV heads                  caches 2 x  4 x 64 =  512
    mla        DeepSeek-V2, latent 256 + rope 32  caches      256 + 32 =  288

For each, a prefill engine (producer connector, real gRPC server on 127.0.0.1) computes a
``PROMPT_TOKENS``-token prompt and a decode engine in this process pulls its blocks and
decodes 4 tokens; the decode engine's transfer stats give the bytes moved, and the time from
adding the request to its first decoded token (the pull, then one decode step) is the
hand-off. Ratios are against GQA (the common deployment).

Run: python bench/bench_mla.py   (about a minute on 2 cores)
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import transformers
from random_checkpoint import save_random_checkpoint

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.kvconnector.pd.pd_connector import PDConnector
from pdserve.messages.connector_config import KVConnectorConfig

WIDTH = dict(
    vocab_size=1024,
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=16,
    max_position_embeddings=8192,
    eos_token_id=1,
)
MODELS = {
    "mha": (transformers.LlamaConfig, dict(num_key_value_heads=16, head_dim=64)),
    "gqa": (transformers.LlamaConfig, dict(num_key_value_heads=4, head_dim=64)),
    "mla": (
        transformers.DeepseekV2Config,
        dict(
            num_key_value_heads=16,
            q_lora_rank=None,
            kv_lora_rank=256,
            qk_rope_head_dim=32,
            qk_nope_head_dim=64,
            v_head_dim=64,
            first_k_dense_replace=8,  # every layer dense: attention is what differs
        ),
    ),
}
PROMPT_TOKENS, BLOCK_SIZE, ROUNDS = 2048, 16, 3
ENGINE = dict(block_size=BLOCK_SIZE, num_kv_blocks=2 * PROMPT_TOKENS // BLOCK_SIZE + 8)


def save(directory: Path, config_class: type, overrides: dict) -> str:
    config = config_class(**WIDTH, **overrides)
    torch.manual_seed(0)
    architecture = getattr(transformers, config_class.__name__.replace("Config", "ForCausalLM"))
    return save_random_checkpoint(architecture(config), directory)


def connector(role: str, engine_id: str) -> PDConnector:
    config = KVConnectorConfig(role=role, transport="grpc", allow_insecure=True)
    return PDConnector(config, engine_id=engine_id, hash_algorithm="xxh3_128", hash_seed=0)


def hand_off(model: str, rounds: int) -> tuple[int, int, float]:
    """(bytes moved, blocks moved, best hand-off seconds) per prompt, over ``rounds`` prompts."""
    producer = connector("producer", "prefill-0")
    prefill = LLMEngine.from_pretrained(
        model, connector=producer, engine_id="prefill-0", max_num_batched_tokens=512, **ENGINE
    )
    decode = LLMEngine.from_pretrained(
        model, connector=connector("consumer", "decode-0"), engine_id="decode-0", **ENGINE
    )
    rng = random.Random(0)
    best = float("inf")
    for index in range(rounds):
        prompt = [rng.randrange(2, WIDTH["vocab_size"]) for _ in range(PROMPT_TOKENS)]
        request_id = f"r{index}"
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        # The first token only, as the gateway asks a prefill worker.
        first_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        prefill.add_request(request_id, prompt, first_token, remote_decode=True)
        done = None
        while done is None:
            done = next((o for o in prefill.step() if o.finished), None)
        producer.complete_transfer_params(done.kv_transfer_params)
        start = time.perf_counter()
        decode.add_request(request_id, prompt, params, kv_transfer_params=done.kv_transfer_params)
        decoded: list[object] = []
        while not decoded:  # the pull, then the step that decodes the next token
            decoded = [o for o in decode.step() if o.request_id == request_id]
        best = min(best, time.perf_counter() - start)
        while decode.has_unfinished_requests():
            decode.step()
        while prefill.num_leases_held:
            prefill.step()
            time.sleep(0.001)
    transfer = decode.stats().transfer
    decode.shutdown()
    prefill.shutdown()
    return transfer.num_bytes_received // rounds, transfer.num_blocks_received // rounds, best


def main() -> None:
    torch.set_num_threads(1)
    rows = {}
    with tempfile.TemporaryDirectory() as root:
        for name, (config_class, overrides) in MODELS.items():
            directory = Path(root) / name
            directory.mkdir()
            rows[name] = hand_off(save(directory, config_class, overrides), ROUNDS)
    base_bytes, _, base_s = rows["gqa"]
    print(f"prompt of {PROMPT_TOKENS} tokens, {WIDTH['num_hidden_layers']} layers, fp32 KV")
    print(
        f"{'model':6} {'KiB/token':>10} {'blocks':>7} {'MiB moved':>10} {'vs gqa':>7} {'hand-off ms':>11} {'vs gqa':>7}"
    )
    for name, (moved, blocks, seconds) in rows.items():
        print(
            f"{name:6} {moved / PROMPT_TOKENS / 1024:10.2f} {blocks:7d} {moved / 2**20:10.1f} "
            f"{moved / base_bytes:7.2f} {seconds * 1e3:11.1f} {seconds / base_s:7.2f}"
        )


if __name__ == "__main__":
    main()
