"""Turning logits into tokens, reproducibly per request.

The token at output position ``i`` of a request is a function of ``(seed, i, logits)``
only: the random draw comes from a CPU ``torch.Generator`` seeded with a hash of
``(seed, i)``, never from a shared stream. So a request sampled in any batch, in any
order, on a prefill worker or a decode worker, gets the same token for the same logits.

A sampled row draws by the exponential race (the Gumbel-max trick in another form):
``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. picks token ``t`` with probability ``p_t``,
and needs one vector of noise per row, no cumulative sums. Greedy rows (temperature
0) are one vectorized argmax.

Structured outputs mask here, in one place, before greedy and sampled rows part ways: the
batch's token bitmask sets every forbidden logit to -inf on a copy, so the draw (and the
argmax) only ever picks a token the row's grammar allows. Logprobs are taken from the raw
logits (vLLM's default ``raw_logprobs``): the model's distribution, not the masked one.
"""

from __future__ import annotations

import torch

from pdserve.engine.token_bitmask import apply_token_bitmask
from pdserve.messages.logprobs import TokenLogprobs
from pdserve.messages.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, output_position: int) -> int:
    """A 63-bit generator seed mixed from ``(seed, output_position)`` (splitmix64 finaliser)."""
    x = (seed * 0x9E3779B97F4A7C15 + output_position + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    output_positions: list[int],
    token_bitmask: torch.Tensor | None = None,
) -> list[int]:
    """One token per row of ``logits`` ``[n, vocab]`` (float32).

    ``seeds[r]`` is row ``r``'s effective seed (the request's, or the one drawn at
    arrival) and ``output_positions[r]`` the index of the token being sampled in the
    request's output (0 for the first token). ``token_bitmask`` (``token_bitmask.py``):
    the tokens each row's grammar allows, or None when no row has one.
    """
    num_rows = logits.shape[0]
    if not len(params) == len(seeds) == len(output_positions) == num_rows:
        raise ValueError(
            f"sample() got {num_rows} logit rows but {len(params)} params, {len(seeds)} seeds "
            f"and {len(output_positions)} output positions"
        )
    if token_bitmask is not None:
        logits = apply_token_bitmask(logits, token_bitmask)
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1).tolist()
    tokens = [0] * num_rows
    greedy_rows = [r for r in range(num_rows) if params[r].greedy]
    if greedy_rows:
        picked = logits[greedy_rows].argmax(dim=-1).tolist()
        for row, token in zip(greedy_rows, picked):
            tokens[row] = token
    sampled_rows = [r for r in range(num_rows) if not params[r].greedy]
    if sampled_rows:
        sampled_logits = logits[sampled_rows].float().cpu()
        for index, row in enumerate(sampled_rows):
            draw = draw_seed(seeds[row], output_positions[row])
            tokens[row] = _sample_row(sampled_logits[index], params[row], draw)
    return tokens


def _sample_row(logits: torch.Tensor, params: SamplingParams, draw: int) -> int:
    """Temperature, then top-k, then top-p, then the exponential race with the row's own noise."""
    scaled = logits / params.temperature
    vocab_size = scaled.shape[0]
    if 0 < params.top_k < vocab_size:
        kth_largest = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, sorted_ids = torch.sort(probs, descending=True)
        # Drop a token when the ones ranked above it already reach top_p; the top one always stays.
        drop_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        probs = probs.masked_fill(drop_sorted.scatter(0, sorted_ids, drop_sorted), 0.0)
    generator = torch.Generator(device="cpu").manual_seed(draw)
    noise = torch.empty(vocab_size).exponential_(generator=generator)
    return int(torch.argmax(probs / noise))


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_top: list[int]
) -> list[TokenLogprobs]:
    """Each row's sampled token's logprob and its ``num_top[r]`` best alternatives, from the
    raw logits (one ``log_softmax`` over the rows that asked, one ``topk`` for the widest)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(
        1, torch.tensor(token_ids, dtype=torch.long, device=logits.device).unsqueeze(1)
    ).squeeze(1)
    widest = max(num_top, default=0)
    # Only when some row asks for top alternatives (then widest >= that row's k > 0).
    widest_top = logprobs.topk(widest, dim=-1) if widest else None
    results = []
    for row, token_id in enumerate(token_ids):
        k = num_top[row]
        top: list[tuple[int, float]] = []
        if k and widest_top is not None:
            top_values, top_ids = widest_top
            top = list(zip(top_ids[row, :k].tolist(), top_values[row, :k].tolist()))
        results.append(TokenLogprobs(token_id, float(chosen[row]), top))
    return results
