"""Tensor-parallel slices of a model, joined over a real gloo group of spawned processes,
give TP=1's greedy tokens (and its logits within float32's summation-order tolerance).
A GGUF whose weights stay packed (Q4_1 layers, a Q8_0 tied embedding) splits too: rows of
the column-parallel and vocabulary slices, whole groups of 32 inputs of the row-parallel ones.

Each rank builds the same seeded model, keeps its slice (``LlamaForCausalLM.shard``) and
runs a greedy decode through its own ``ModelRunner``, attending over its KV heads' view of
its pages; rank 0 reports the tokens and the logits of every step.
"""

from __future__ import annotations

import dataclasses
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gguf import GGMLQuantizationType as Quant

from pdserve.engine.model_input import ScheduledChunk
from pdserve.engine.model_runner import ModelRunner
from pdserve.model.architectures import build_model
from pdserve.model.loader import load_model
from pdserve.model.model_config import ModelConfig
from pdserve.model.tensor_parallel import TensorParallel, join_group
from pdserve.model.tiny_model import tiny_model_config
from tests.model.test_gguf_loader import gguf_tensors, random_model, write_gguf

PROMPT = [5, 77, 300, 12, 9, 41, 250, 3, 18, 99, 402, 7, 64, 128, 33, 2, 71]
STEPS = 12


def _config(kind: str) -> ModelConfig:
    config = tiny_model_config()
    if kind == "qwen2":  # biased q/k/v, untied head, an odd vocabulary (uneven vocab split)
        config = dataclasses.replace(
            config, architecture="Qwen2ForCausalLM", attention_bias=True, vocab_size=509
        )
    return config


def _model(config: ModelConfig) -> torch.nn.Module:
    with torch.device("cpu"):
        model = build_model(config)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.eval()


def _greedy(kind: str, tensor_parallel: TensorParallel | None) -> tuple[list[int], torch.Tensor]:
    """``kind``: a config of ``_config``, or ``gguf:<path>`` loaded packed."""
    if kind.startswith("gguf:"):
        model, config, _ = load_model(kind.removeprefix("gguf:"), quantization="auto")
    else:
        config = _config(kind)
        model = _model(config)
    prompt = [token % config.vocab_size for token in PROMPT]
    # The runner shards the model and attends over its KV heads' view of the pages.
    runner = ModelRunner(model, config, 8, 16, tensor_parallel=tensor_parallel)
    blocks = [1, 2, 3]
    chunk = ScheduledChunk("r", prompt, 0, blocks, sample=True)
    tokens, logits = [], []
    for _ in range(STEPS):
        step_logits = runner.execute([chunk])
        logits.append(step_logits[0])
        tokens.append(int(step_logits.argmax()))
        position = len(prompt) + len(tokens) - 1
        chunk = ScheduledChunk("r", [tokens[-1]], position, blocks, sample=True)
    return tokens, torch.stack(logits)


def _rank(rank: int, world_size: int, port: int, kinds: list[str], results: dict) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0)
    tensor_parallel = join_group(store, rank, world_size, timedelta(seconds=60))
    for kind in kinds:
        tokens, logits = _greedy(kind, tensor_parallel)
        if rank == 0:
            results[kind] = (tokens, logits.tolist())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(
    ("world_size", "kinds"),
    [(2, ["tiny", "qwen2", "packed"]), (4, ["tiny"])],
    ids=["tp2-kv-split", "tp4-kv-replicated"],
)
def test_tensor_parallel_ranks_match_a_single_process(
    world_size: int, kinds: list[str], tmp_path
) -> None:
    """TP=2 splits tiny's 2 KV heads (and runs a biased Qwen2 with an uneven vocabulary
    split, and a packed GGUF); TP=4 replicates each KV head on two ranks."""
    if "packed" in kinds:
        path = tmp_path / "llama-q4_1.gguf"
        tensors = gguf_tensors(random_model(tie_word_embeddings=True))
        tensors.pop("output.weight")  # tied: the LM head is the packed embedding
        write_gguf(path, tensors, Quant.Q4_1)
        kinds = [f"gguf:{path}" if kind == "packed" else kind for kind in kinds]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(world_size, _free_port(), kinds, results), nprocs=world_size)
        outputs = dict(results)
    for kind in kinds:
        expected_tokens, expected_logits = _greedy(kind, None)
        tokens, logits = outputs[kind]
        assert tokens == expected_tokens, kind
        assert len(set(tokens)) > 3  # a decode that moves, not one token repeated
        # The integer-dot kernel rounds each activation to a 16-bit step (max |x_g| / 32258,
        # int4_tiles_kernel.py): the all-reduce's other order of float sums can move one
        # across a rounding boundary, a jump some 2^8 float32 ulps wide, so a packed model's
        # logits agree to 2e-3 (about 2e-4 of their spread), its tokens exactly.
        tolerance = 2e-3 if kind.startswith("gguf:") else 1e-4
        torch.testing.assert_close(
            torch.tensor(logits),
            expected_logits,
            rtol=tolerance,
            atol=tolerance,
            msg=lambda detail, kind=kind: f"{kind}: {detail}",
        )


def test_a_split_the_model_cannot_take_is_refused_naming_it() -> None:
    model = _model(_config("tiny"))
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        model.shard(TensorParallel(0, 3, group=None))  # type: ignore[arg-type]  # never reached
    with pytest.raises(ValueError, match="rank 2 of world_size 2"):
        TensorParallel(2, 2, group=None)  # type: ignore[arg-type]
