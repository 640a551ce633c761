"""``step(delta=True)``: each output holds only what is new, and the deltas add up to the
cumulative outputs exactly (tokens, logprobs, text with stop strings, prompt logprobs once).

Two engines of the same seeded ``tiny`` model run the same requests, one reporting
cumulative outputs, one deltas; chunked prefill and a small batch budget make requests
report at different steps. The worker host streams these deltas (worker/engine_host.py).
"""

from __future__ import annotations

import random

from pdserve.engine import LLMEngine, RequestOutput, SamplingParams


def requests() -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(4)
    kinds = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=30, temperature=0.8, seed=7, stop=["4/", "*"]),
        SamplingParams(max_tokens=20, temperature=0.0, prompt_logprobs=1, logprobs=0),
        SamplingParams(max_tokens=25, temperature=1.0, seed=3, top_p=0.9),
    ]
    return [
        (f"r{i}", [rng.randrange(256) for _ in range(rng.randrange(5, 90))], kinds[i % 4])
        for i in range(12)
    ]


def run(delta: bool) -> tuple[dict[str, RequestOutput], dict[str, list[RequestOutput]]]:
    engine = LLMEngine.from_pretrained("tiny", max_num_batched_tokens=64, seed=1)
    for request_id, prompt, params in requests():
        engine.add_request(request_id, prompt, params)
    joined: dict[str, RequestOutput] = {}
    every: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step(delta=delta):
            every.setdefault(output.request_id, []).append(output)
            earlier = joined.get(output.request_id)
            joined[output.request_id] = output if earlier is None else earlier.followed_by(output)
    return joined, every


def test_deltas_add_up_to_the_cumulative_outputs() -> None:
    cumulative, _ = run(delta=False)
    joined, deltas = run(delta=True)
    assert joined.keys() == cumulative.keys() and len(joined) == 12
    for request_id, whole in cumulative.items():
        summed = joined[request_id]
        assert summed.finished and whole.finished
        assert summed.output_token_ids == whole.output_token_ids
        assert summed.output_logprobs == whole.output_logprobs
        assert summed.text == whole.text
        assert summed.prompt_logprobs == whole.prompt_logprobs
        assert summed.finish_reason == whole.finish_reason
        assert summed.stop_reason == whole.stop_reason
    assert any(cumulative[f"r{i}"].prompt_logprobs for i in (2, 6, 10))
    assert any(out.stop_reason for out in cumulative.values())


def test_each_delta_holds_only_its_new_tokens_and_counts_the_whole() -> None:
    _, deltas = run(delta=True)
    for outputs in deltas.values():
        count = 0
        for output in outputs:
            assert output.delta
            count += len(output.output_token_ids)
            assert output.num_output_tokens == count
            assert len(output.output_logprobs) in (0, len(output.output_token_ids))
        assert sum(bool(output.prompt_logprobs) for output in outputs) <= 1
