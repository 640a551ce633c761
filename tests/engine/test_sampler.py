"""Sampling: a token depends only on (seed, output position, logits)."""

from __future__ import annotations

import torch

from pdserve.engine.sampler import sample
from pdserve.messages.sampling_params import SamplingParams

VOCAB = 64


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def test_token_depends_only_on_seed_position_and_logits_not_on_batch():
    logits = random_logits(6)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20)] * 6
    seeds, positions = [11, 12, 13, 14, 15, 16], [0, 3, 1, 7, 2, 5]
    batched = sample(logits, params, seeds, positions)
    alone = [sample(logits[r : r + 1], params[:1], [seeds[r]], [positions[r]])[0] for r in range(6)]
    reversed_batch = sample(logits.flip(0), params, seeds[::-1], positions[::-1])[::-1]
    mixed = sample(
        torch.cat([random_logits(1, seed=9), logits[2:3]]),
        [SamplingParams(temperature=0.0), params[2]],
        [0, seeds[2]],
        [0, positions[2]],
    )
    assert batched == alone == reversed_batch
    assert mixed[1] == batched[2]


def test_rows_with_different_settings_in_one_batch_sample_as_they_would_alone():
    """The batch samples in tensor ops; a row's top-k / top-p / temperature (or none) must
    not leak into its neighbours' draws."""
    logits = random_logits(40, seed=3) * 3
    settings = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=30, top_p=0.95),
        SamplingParams(temperature=0.0),
    ]
    params = [settings[r % len(settings)] for r in range(40)]
    seeds, positions = list(range(100, 140)), [r % 7 for r in range(40)]
    batched = sample(logits, params, seeds, positions)
    alone = [
        sample(logits[r : r + 1], [params[r]], [seeds[r]], [positions[r]])[0] for r in range(40)
    ]
    assert batched == alone
    assert len(set(batched)) > 10  # the rows really sample


def test_greedy_is_argmax():
    logits = random_logits(5)
    tokens = sample(logits, [SamplingParams(temperature=0.0)] * 5, [1] * 5, [0] * 5)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_top_k_restricts_to_the_k_largest():
    logits = random_logits(1)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    params = [SamplingParams(temperature=5.0, top_k=3)]
    drawn = {sample(logits, params, [seed], [0])[0] for seed in range(200)}
    assert drawn <= allowed and len(drawn) > 1


def test_top_p_restricts_to_the_nucleus():
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, [4, 9, 20]] = torch.tensor([2.0, 1.5, 1.0])
    params = [SamplingParams(temperature=1.0, top_p=0.6)]
    drawn = {
        sample(logits, params, [seed], [position])[0] for seed in range(50) for position in range(4)
    }
    assert drawn == {4, 9}  # p(4) ≈ 0.51 < 0.6, so 9 joins; 4 and 9 together pass 0.6


def test_temperature_sampling_varies_across_seeds_and_positions():
    logits = random_logits(1) / 4
    params = [SamplingParams(temperature=1.0)]
    across_seeds = {sample(logits, params, [seed], [0])[0] for seed in range(100)}
    across_positions = {sample(logits, params, [7], [position])[0] for position in range(100)}
    assert len(across_seeds) > 10 and len(across_positions) > 10
