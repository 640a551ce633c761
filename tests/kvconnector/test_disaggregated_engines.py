"""Prefill and decode engines in two real processes, KV moved over real gRPC and NIXL.

The decode engine (this process) must produce exactly the colocated engine's tokens while
computing none of the prompt, and every fault must end with every block free on both sides.
"""

from __future__ import annotations

import random
import time

import pytest
import transformers

from pdserve.engine import LLMEngine, RequestOutput, SamplingParams
from pdserve.engine.request import RequestStatus
from pdserve.model.loader import load_model
from tests.engine.hf_models import (
    DEEPSEEK_V2,
    DEEPSEEK_V3,
    GEMMA3,
    MIXTRAL,
    QWEN3_MOE,
    hf_greedy,
    save_hf_model,
)
from tests.kvconnector.disaggregation import (
    assert_decode_idle,
    disaggregate,
    make_decode_engine,
    random_prompts,
    run_to_completion,
)
from tests.kvconnector.kv_peer import TRANSPORTS
from tests.kvconnector.prefill_engine_process import ENGINE_KWARGS

BLOCK_SIZE = ENGINE_KWARGS["block_size"]


def sampling_mix(count: int) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=12, temperature=0.0)
        if i % 2 == 0
        else SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=1000 + i)
        for i in range(count)
    ]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_decode_equals_colocated_and_computes_no_prompt_token(
    transport: str, colocated: LLMEngine, prefill_factory
) -> None:
    prefill = prefill_factory(transport=transport)
    decode = make_decode_engine(transport)
    prompts = random_prompts(7, 8)
    params = sampling_mix(len(prompts))
    expected = [o.output_token_ids for o in colocated.generate(prompts, params)]
    outputs = disaggregate(prefill, decode, prompts, params)
    assert [o.output_token_ids for o in outputs] == expected
    stats = decode.stats()
    # Each output token after the first (sampled on the prefill side) needs exactly one
    # computed token: the previous one. Any prompt token computed here would add to this.
    assert stats.num_scheduled_tokens == sum(len(o.output_token_ids) - 1 for o in outputs)
    assert stats.transfer.num_failed_transfers == 0
    assert stats.transfer.num_blocks_received > 0
    assert_decode_idle(decode)
    prefill.wait_until_idle()
    decode.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shared_prefix_is_not_sent_again(transport: str, prefill_factory) -> None:
    prefill = prefill_factory(transport=transport)
    decode = make_decode_engine(transport)
    rng = random.Random(3)
    prefix = [rng.randrange(256) for _ in range(4 * BLOCK_SIZE)]
    first = prefix + [rng.randrange(256) for _ in range(20)]  # 84 tokens: 6 blocks
    second = prefix + [rng.randrange(256) for _ in range(37)]  # 101 tokens: 7 blocks
    params = [SamplingParams(max_tokens=4, temperature=0.0)]
    disaggregate(prefill, decode, [first], params, prefix="a")
    before = decode.stats().transfer
    disaggregate(prefill, decode, [second], params, prefix="b")
    after = decode.stats().transfer
    assert after.num_dedup_skipped_blocks - before.num_dedup_skipped_blocks == 4
    assert after.num_blocks_received - before.num_blocks_received == 7 - 4
    assert_decode_idle(decode)
    prefill.wait_until_idle()
    decode.shutdown()


def test_prefill_killed_mid_transfer_decode_recomputes(
    colocated: LLMEngine, prefill_factory
) -> None:
    prefill = prefill_factory(transport="grpc")
    decode = make_decode_engine("grpc", transfer_timeout_s=5.0)
    prompt = random_prompts(11, 1)[0]
    params = [SamplingParams(max_tokens=10, temperature=0.0)]
    prefilled = prefill.prefill("k0", prompt, params[0])
    prefill.fault(die_on_read=True)
    decode.add_request("k0", prompt, params[0], kv_transfer_params=prefilled.kv_transfer_params)
    (output,) = run_to_completion(decode, ["k0"])
    prefill.process.join(10)
    assert not prefill.process.is_alive(), "the prefill process should have died mid-stream"
    assert output.output_token_ids == colocated.generate([prompt], params)[0].output_token_ids
    assert decode.stats().num_recompute_fallbacks == 1
    provenance = output.kv_provenance  # nothing arrived: the whole prompt was recomputed here
    assert (provenance.num_pulled_tokens, provenance.num_recomputed_tokens) == (0, len(prompt))
    assert_decode_idle(decode)
    decode.shutdown()


def test_lease_never_released_expires_and_frees(prefill_factory) -> None:
    prefill = prefill_factory(transport="grpc", lease_ttl_s=0.5)
    prefilled = prefill.prefill("e0", random_prompts(12, 1)[0], SamplingParams(max_tokens=8))
    assert prefilled.kv_transfer_params is not None
    assert prefill.state().num_leases == 1
    state = prefill.wait_until_idle(timeout_s=10)
    assert state.num_lease_expiries == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_corrupted_block_is_dropped_and_recomputed(
    transport: str, colocated: LLMEngine, prefill_factory
) -> None:
    prefill = prefill_factory(transport=transport)
    decode = make_decode_engine(transport)
    prompt = random_prompts(13, 1)[0]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    prefilled = prefill.prefill("c0", prompt, params)
    corrupt_index = 1
    prefill.corrupt(prefilled.kv_transfer_params.block_ids[corrupt_index])
    decode.add_request("c0", prompt, params, kv_transfer_params=prefilled.kv_transfer_params)
    (output,) = run_to_completion(decode, ["c0"])
    assert output.output_token_ids == colocated.generate([prompt], params)[0].output_token_ids
    stats = decode.stats()
    assert stats.transfer.num_failed_blocks == 1
    assert stats.num_recompute_fallbacks == 1
    # Tokens from the corrupt block on were recomputed here, and nothing before it.
    recomputed = len(prompt) - corrupt_index * BLOCK_SIZE
    assert stats.num_scheduled_tokens == recomputed + len(output.output_token_ids) - 1
    # The request's provenance says the same, and its bytes are the transfer counters'.
    provenance = output.kv_provenance
    assert (
        provenance.num_cache_hit_tokens,
        provenance.num_pulled_tokens,
        provenance.num_recomputed_tokens,
        provenance.num_computed_tokens,
    ) == (0, corrupt_index * BLOCK_SIZE, recomputed, 0)
    assert provenance.num_blocks_pulled == stats.transfer.num_blocks_received
    assert provenance.num_bytes_pulled == stats.transfer.num_bytes_received > 0
    assert_decode_idle(decode)
    prefill.wait_until_idle()
    decode.shutdown()


@pytest.mark.parametrize(
    "prefill_spec, decode_spec, named",
    [
        ({"hash_seed": 1}, {"hash_seed": 2}, "hash_seed: local=2 remote=1"),
        ({"kv_cache_dtype": "float16"}, {}, "dtype: local='float32' remote='float16'"),
    ],
    ids=["hash-seed", "kv-cache-dtype"],
)
def test_incompatible_layout_is_refused_with_both_values(
    prefill_factory, prefill_spec, decode_spec, named
) -> None:
    prefill = prefill_factory(transport="grpc", lease_ttl_s=2.0, **prefill_spec)
    decode = make_decode_engine("grpc", failure_policy="fail", **decode_spec)
    assert_the_pull_is_refused(prefill, decode, named)


def assert_the_pull_is_refused(prefill, decode: LLMEngine, *named: str) -> None:
    """A request handed from ``prefill`` to ``decode`` ends in an error naming ``named``,
    with no block read. A refused handshake releases nothing: the lease ends at its TTL."""
    prompt = random_prompts(14, 1)[0]
    params = SamplingParams(max_tokens=5, temperature=0.0)
    prefilled = prefill.prefill("m0", prompt, params)
    decode.add_request("m0", prompt, params, kv_transfer_params=prefilled.kv_transfer_params)
    (output,) = run_to_completion(decode, ["m0"])
    assert output.finish_reason == "error"
    assert all(name in output.error for name in named), output.error
    assert decode.stats().transfer.num_blocks_received == 0
    assert_decode_idle(decode)
    prefill.wait_until_idle()
    decode.shutdown()


def test_a_peer_of_another_model_with_the_same_page_shape_is_refused(
    prefill_factory, tmp_path
) -> None:
    """A decode worker on a Qwen3 whose KV pages have exactly tiny's shape (4 layers, 2 KV
    heads of 64, float32): every page would land and verify (checksums are the sender's)
    and decode as another model's KV. The handshake refuses it naming both models."""
    save_hf_model(
        tmp_path,
        transformers.Qwen3Config,
        vocab_size=512,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    prefill = prefill_factory(transport="grpc", lease_ttl_s=2.0)
    decode = make_decode_engine("grpc", failure_policy="fail", model=tmp_path)
    tiny = LLMEngine.from_pretrained("tiny", **ENGINE_KWARGS).runner.kv_cache
    assert decode.runner.kv_cache[0].shape == tiny[0].shape  # the same page, byte for byte
    assert_the_pull_is_refused(
        prefill, decode, "model: local='Qwen3ForCausalLM:", "remote='LlamaForCausalLM:"
    )


def test_a_first_token_that_completes_a_stop_string_ends_there_and_holds_no_lease(
    prefill_factory,
) -> None:
    """The prefill's one token ("M", tiny's greedy first token here) completes the stop
    string: the request stopped, it did not reach its length, so nothing is handed off
    (it was reported as "length" with a lease, and the gateway sent it on to decode)."""
    prefill = prefill_factory(transport="grpc")
    prompt = [(7 * i + 6) % 256 for i in range(40)]
    params = SamplingParams(max_tokens=1, temperature=0.0, stop=["M"])
    output = prefill.prefill("s0", prompt, params)
    assert (output.finish_reason, output.stop_reason) == ("stop", "M")
    assert output.kv_transfer_params is None and output.text == ""
    prefill.wait_until_idle()


def test_a_first_token_that_is_a_stop_token_for_decode_ends_it_on_arrival_without_its_text(
    prefill_factory,
) -> None:
    """The decode side's params stop on the token the prefill sampled first: the request
    ends as it arrives, with the token's id and not its text (vLLM's rule for stop tokens;
    its text was output on this path), and the lease is released unread."""
    prefill = prefill_factory(transport="grpc")
    decode = make_decode_engine("grpc")
    try:
        prompt = [(7 * i + 6) % 256 for i in range(40)]
        first = prefill.prefill("s0", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        (first_token,) = first.output_token_ids
        assert first_token < 256  # a byte: its text shows
        stopping = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first_token])
        decode.add_request("s0", prompt, stopping, kv_transfer_params=first.kv_transfer_params)
        (output,) = [o for o in decode.step() if o.finished]
        assert (output.output_token_ids, output.text) == ([first_token], "")
        assert (output.finish_reason, output.stop_reason) == ("stop", first_token)
        prefill.wait_until_idle()  # the lease was released: nothing is held there
    finally:
        decode.shutdown()


def test_a_peer_of_the_same_config_with_other_weights_is_refused(prefill_factory, tmp_path):
    """A fine-tune beside its base, or a rolling update to new weights: one config.json,
    pages of one shape, K/V that mean different things (the reviewer's repro decoded the
    other's pages into other tokens, every checksum verifying). The fingerprint covers the
    weights' digest, so the handshake refuses the pair, naming both."""
    for name, seed in (("a", 0), ("b", 1)):  # tiny's vocabulary: the helper's prompts
        save_hf_model(tmp_path / name, transformers.LlamaConfig, seed=seed, vocab_size=512)
    prefill = prefill_factory(transport="grpc", lease_ttl_s=2.0, model=str(tmp_path / "a"))
    decode = make_decode_engine("grpc", failure_policy="fail", model=tmp_path / "b")
    _, remote, _ = load_model(str(tmp_path / "a"), decode.model_config.dtype)
    assert remote.fingerprint != decode.model_config.fingerprint
    assert_the_pull_is_refused(
        prefill,
        decode,
        f"model: local='{decode.model_config.fingerprint}'",
        f"remote='{remote.fingerprint}'",
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "config_class, overrides",
    [
        pytest.param(transformers.Qwen3Config, {"head_dim": 32}, id="qwen3"),
        pytest.param(transformers.Qwen3MoeConfig, QWEN3_MOE, id="qwen3-moe"),
        pytest.param(transformers.MixtralConfig, MIXTRAL, id="mixtral"),
        pytest.param(transformers.DeepseekV2Config, DEEPSEEK_V2, id="deepseek-v2"),
        pytest.param(transformers.DeepseekV3Config, DEEPSEEK_V3, id="deepseek-v3"),
        pytest.param(transformers.Gemma3TextConfig, GEMMA3, id="gemma3"),
    ],
)
def test_a_pair_of_each_new_family_decodes_as_transformers(
    transport: str, config_class, overrides, prefill_factory, tmp_path
) -> None:
    """Qwen3 (q/k norms, head_dim apart from hidden / heads), Qwen3-MoE, Mixtral and DeepSeek
    V2/V3 and Gemma 3 saved by transformers: P/D greedy tokens equal transformers' own, on
    prompts sharing a prefix, and each moved block is the bytes the family caches per token:
    K and V per KV head, or MLA's latent row only. Gemma 3 hands off every KV group (its
    windowed groups only the blocks the next token reads: the rest are null on both sides)."""
    reference = save_hf_model(tmp_path, config_class, **overrides)
    prefill = prefill_factory(transport=transport, model=str(tmp_path))
    decode = make_decode_engine(transport, model=tmp_path)
    rng = random.Random(5)
    prefix = [rng.randrange(2, 96) for _ in range(40)]
    prompts = [prefix + [rng.randrange(2, 96) for _ in range(n)] for n in (7, 23, 50)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outputs = disaggregate(prefill, decode, prompts, [params] * len(prompts))
    assert [o.output_token_ids for o in outputs] == [hf_greedy(reference, p, 32) for p in prompts]
    hf = reference.config
    if hasattr(hf, "kv_lora_rank"):
        per_token = hf.kv_lora_rank + hf.qk_rope_head_dim
    else:
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        per_token = 2 * hf.num_key_value_heads * head_dim
    # Gemma 3's global and windowed layers are KV groups of as many layers as it has global
    # ones; a block holds one group's layers (ModelConfig.kv_layer_groups).
    layer_types = list(getattr(hf, "layer_types", None) or [])
    mixed = len(set(layer_types)) > 1
    layers_per_block = layer_types.count("full_attention") if mixed else hf.num_hidden_layers
    transfer = decode.stats().transfer
    assert transfer.num_blocks_received > 0
    assert transfer.num_bytes_received == (
        transfer.num_blocks_received * layers_per_block * BLOCK_SIZE * per_token * 4
    )
    assert_decode_idle(decode)
    prefill.wait_until_idle()
    decode.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_16_bit_cache_moves_half_the_bytes_and_decodes_as_colocated(
    transport: str, prefill_factory
) -> None:
    """float16 KV under the float32 tiny model on both sides: the decode worker's tokens are
    a colocated float16-KV engine's, from pages of half the float32 ones' bytes."""
    prefill = prefill_factory(transport=transport, kv_cache_dtype="float16")
    decode = make_decode_engine(transport, kv_cache_dtype="float16")
    colocated = LLMEngine.from_pretrained("tiny", kv_cache_dtype="float16", **ENGINE_KWARGS)
    prompts = random_prompts(21, 6)
    params = sampling_mix(len(prompts))
    expected = [o.output_token_ids for o in colocated.generate(prompts, params)]
    outputs = disaggregate(prefill, decode, prompts, params)
    assert [o.output_token_ids for o in outputs] == expected
    transfer = decode.stats().transfer
    float32_page_bytes = colocated.runner.kv_cache[0].numel() * 4
    assert transfer.num_blocks_received > 0
    assert transfer.num_bytes_received == transfer.num_blocks_received * float32_page_bytes // 2
    assert_decode_idle(decode)
    prefill.wait_until_idle()
    decode.shutdown()


def test_decode_abort_while_waiting_for_kv_frees_after_the_transfer(prefill_factory) -> None:
    prefill = prefill_factory(transport="grpc")
    decode = make_decode_engine("grpc", transfer_timeout_s=1.0)
    prompt = random_prompts(15, 1)[0]
    params = SamplingParams(max_tokens=5, temperature=0.0)
    prefilled = prefill.prefill("w0", prompt, params)
    prefill.fault(stall_s=2.0)
    decode.add_request("w0", prompt, params, kv_transfer_params=prefilled.kv_transfer_params)
    decode.step()
    request = decode.scheduler.requests["w0"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert decode.abort("w0")
    # The pull still writes into the request's blocks: they must not be free yet.
    assert decode.kv_cache_manager.usage > 0
    deadline = time.monotonic() + 15
    while decode.has_unfinished_requests() or decode.connector.has_pending_loads():
        assert time.monotonic() < deadline, "the aborted request never released its blocks"
        decode.step()
    decode.step()
    assert_decode_idle(decode)
    prefill.fault(stall_s=0.0)
    prefill.wait_until_idle(timeout_s=15)
    decode.shutdown()


def test_a_lease_near_expiry_is_renewed_before_the_pull(
    colocated: LLMEngine, prefill_factory
) -> None:
    prefill = prefill_factory(transport="grpc", lease_ttl_s=2.0)
    decode = make_decode_engine("grpc")
    prompt = random_prompts(16, 1)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prefilled = prefill.prefill("n0", prompt, params)
    # As if the request had queued behind a full pool on the decode side: less than half of
    # the lease's TTL left by the hand-off's clock (the lease itself is still good).
    prefilled.kv_transfer_params.lease_expires_at = time.time() + 0.4
    decode.add_request("n0", prompt, params, kv_transfer_params=prefilled.kv_transfer_params)
    (output,) = run_to_completion(decode, ["n0"])
    assert output.output_token_ids == colocated.generate([prompt], params)[0].output_token_ids
    stats = decode.stats()
    assert stats.transfer.num_lease_renewals == 1
    assert stats.num_recompute_fallbacks == 0
    assert_decode_idle(decode)
    assert prefill.wait_until_idle().num_lease_expiries == 0
    decode.shutdown()


def test_dedup_is_counted_once_when_admission_waits_for_a_full_pool(prefill_factory) -> None:
    prefill = prefill_factory(transport="grpc")
    decode = make_decode_engine("grpc", num_kv_blocks=11)  # 10 usable blocks of 16 tokens
    rng = random.Random(17)
    prefix = [rng.randrange(256) for _ in range(4 * BLOCK_SIZE)]
    first = prefix + [rng.randrange(256) for _ in range(40)]  # grows to 9 blocks
    second = prefix + [rng.randrange(256) for _ in range(20)]  # needs 2 blocks beyond the prefix
    long_params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    short_params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prefilled = prefill.prefill("p0", first, long_params)
    decode.add_request("p0", first, long_params, kv_transfer_params=prefilled.kv_transfer_params)
    while decode.kv_cache_manager.get_num_free_blocks() > 1:
        decode.step()
    before = decode.stats().transfer.num_dedup_skipped_blocks
    prefilled = prefill.prefill("p1", second, short_params)
    decode.add_request("p1", second, short_params, kv_transfer_params=prefilled.kv_transfer_params)
    outputs = run_to_completion(decode, ["p0", "p1"])
    assert all(out.finish_reason == "length" for out in outputs)
    assert decode.stats().transfer.num_dedup_skipped_blocks - before == 4
    assert_decode_idle(decode)
    prefill.wait_until_idle()
    decode.shutdown()


def test_a_pull_that_loses_the_first_block_recomputes_the_whole_prompt(
    colocated: LLMEngine, prefill_factory
) -> None:
    prefill = prefill_factory(transport="grpc")
    decode = make_decode_engine("grpc")
    prompt = random_prompts(18, 1)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prefilled = prefill.prefill("f0", prompt, params)
    prefill.corrupt(prefilled.kv_transfer_params.block_ids[0])
    decode.add_request("f0", prompt, params, kv_transfer_params=prefilled.kv_transfer_params)
    (output,) = run_to_completion(decode, ["f0"])
    assert output.output_token_ids == colocated.generate([prompt], params)[0].output_token_ids
    stats = decode.stats()
    assert stats.num_recompute_fallbacks == 1
    assert stats.num_scheduled_tokens == len(prompt) + len(output.output_token_ids) - 1
    assert_decode_idle(decode)
    prefill.wait_until_idle()
    decode.shutdown()


def test_running_decodes_keep_stepping_while_a_long_prompt_is_recomputed(
    colocated: LLMEngine, prefill_factory
) -> None:
    """A recompute fallback is computed in chunks of ``long_prefill_token_threshold``: the
    running decode gets a token every step meanwhile (uncapped, the whole prompt took one
    step of the full budget)."""
    threshold = BLOCK_SIZE
    prefill = prefill_factory(transport="grpc")
    decode = make_decode_engine("grpc", long_prefill_token_threshold=threshold)
    running_prompt, long_prompt = random_prompts(19, 1)[0], random_prompts(23, 1)[0]
    running_params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    long_params = SamplingParams(max_tokens=4, temperature=0.0)
    prefilled = prefill.prefill("d0", running_prompt, running_params)
    decode.add_request(
        "d0", running_prompt, running_params, kv_transfer_params=prefilled.kv_transfer_params
    )
    while "d0" not in [r.request_id for r in decode.scheduler.running]:
        decode.step()
    prefilled = prefill.prefill("l0", long_prompt, long_params)
    prefill.corrupt(prefilled.kv_transfer_params.block_ids[0])  # the whole prompt recomputes
    decode.add_request(
        "l0", long_prompt, long_params, kv_transfer_params=prefilled.kv_transfer_params
    )
    running, recomputing = decode.scheduler.requests["d0"], decode.scheduler.requests["l0"]
    prompt_steps = 0
    outputs: dict[str, RequestOutput] = {}
    while len(outputs) < 2:
        computed_before = recomputing.num_computed_tokens
        tokens_before = running.num_output_tokens
        for out in decode.step():
            if out.finished:
                outputs[out.request_id] = out
        if (
            recomputing.num_computed_tokens > computed_before
            and computed_before < len(long_prompt) - 1
        ):
            prompt_steps += 1
            assert recomputing.num_computed_tokens - computed_before <= threshold
            assert running.num_output_tokens == tokens_before + 1 or running.is_finished
    assert prompt_steps >= len(long_prompt) // threshold
    expected = colocated.generate([running_prompt, long_prompt], [running_params, long_params])
    assert [outputs["d0"].output_token_ids, outputs["l0"].output_token_ids] == [
        o.output_token_ids for o in expected
    ]
    assert decode.stats().num_recompute_fallbacks == 1
    assert_decode_idle(decode)
    prefill.wait_until_idle()
    decode.shutdown()


def test_a_request_joins_static_decode_steps_only_once_its_pages_have_landed(
    prefill_factory,
) -> None:
    """The static decode batch (what a CUDA graph replays on a GPU) reads its rows' pages in
    place: while a request's pull is stalled, it stays out of every decode step and another
    request keeps stepping; once its pages land it joins, and both decode as colocated."""
    prefill = prefill_factory(transport="grpc")
    decode = make_decode_engine("grpc")
    static = decode.runner.static_decode
    assert static is not None, "the tiny float32 decode engine runs the static decode batch"
    steps: list[tuple[list[str], bool]] = []
    fill = static.fill

    def recorded_fill(chunks):
        steps.append(([c.request_id for c in chunks], decode.connector.has_pending_loads()))
        return fill(chunks)

    static.fill = recorded_fill  # type: ignore[method-assign]
    prompts = random_prompts(19, 2)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    colocated = LLMEngine.from_pretrained("tiny", **ENGINE_KWARGS)
    expected = [o.output_token_ids for o in colocated.generate(prompts, [params] * 2)]
    first_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    early = prefill.prefill("early", prompts[0], first_token)
    decode.add_request("early", prompts[0], params, kv_transfer_params=early.kv_transfer_params)
    while not steps:
        decode.step()
    late = prefill.prefill("late", prompts[1], first_token)
    prefill.fault(stall_s=1.5)
    decode.add_request("late", prompts[1], params, kv_transfer_params=late.kv_transfer_params)
    outputs = run_to_completion(decode, ["early", "late"])
    prefill.fault(stall_s=0.0)
    assert [o.output_token_ids for o in outputs] == expected
    assert any(ids == ["early"] and pending for ids, pending in steps), "no step during the pull"
    joined = [pending for ids, pending in steps if "late" in ids]
    assert joined and not any(joined), "late was in a step while its pull was pending"
    assert_decode_idle(decode)
    prefill.wait_until_idle()
    decode.shutdown()
