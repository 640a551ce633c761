"""LoRA adapters across the P/D hand-off: the prefill computes a request's KV under its
adapter, the hand-off names the adapter's weights (``KVTransferParams.lora_digest``), and a
decode worker holding the same files, or reading them on demand from the path the request
brings, decodes exactly what the colocated engine does, over gRPC and NIXL. A decode worker
with other weights under the same name, or without the adapter and not allowed to load it,
refuses the hand-off naming it, and holds nothing after."""

from __future__ import annotations

import dataclasses

import pytest
import safetensors.torch

from pdserve.engine import LLMEngine, SamplingParams
from tests.engine.test_lora import write_folders
from tests.kvconnector.disaggregation import (
    assert_decode_idle,
    make_decode_engine,
    random_prompts,
    run_to_completion,
)
from tests.kvconnector.kv_peer import TRANSPORTS
from tests.kvconnector.prefill_engine_process import ENGINE_KWARGS

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
NAMES = ["qv", None, "everything", "qv"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return write_folders(tmp_path_factory)


def lora_modules(adapters, names=("qv", "everything")) -> dict[str, str]:
    return {name: str(adapters[name]) for name in names}


def prompts_of(seed: int) -> list[list[int]]:
    return [[token % 32 for token in prompt] for prompt in random_prompts(seed, len(NAMES))]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_adapters_decoded_after_a_pull_equal_colocated(transport, folders, prefill_factory):
    base, adapters = folders
    modules = lora_modules(adapters)
    colocated = LLMEngine.from_pretrained(str(base), lora_modules=modules, **ENGINE_KWARGS)
    prompts = prompts_of(61)
    expected = colocated.generate(prompts, GREEDY, lora_names=NAMES)
    prefill = prefill_factory(
        transport=transport, model=str(base), lora_modules=tuple(modules.items())
    )
    # The decode worker holds "qv" only: "everything" it reads from the path a request brings.
    decode = make_decode_engine(
        transport, model=str(base), lora_modules=lora_modules(adapters, ("qv",))
    )
    ids = [f"l{i}" for i in range(len(prompts))]
    for request_id, prompt, name in zip(ids, prompts, NAMES):
        prefilled = prefill.prefill(
            request_id, prompt, dataclasses.replace(GREEDY, max_tokens=1), name
        )
        handoff = prefilled.kv_transfer_params
        assert handoff.lora_digest == (colocated.lora.registered[name].digest if name else None)
        decode.add_request(
            request_id,
            prompt,
            GREEDY,
            kv_transfer_params=handoff,
            lora_name=name,
            lora_path=modules.get(name or ""),
        )
    assert decode.lora.names() == ["everything", "qv"]
    outputs = run_to_completion(decode, ids)
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in expected]
    transfer = decode.stats().transfer
    assert transfer.num_failed_transfers == 0 and transfer.num_blocks_received > 0
    assert_decode_idle(decode)
    prefill.wait_until_idle()
    decode.shutdown()


def test_a_decode_worker_with_other_weights_or_none_refuses_naming_the_adapter(
    folders, prefill_factory, tmp_path
):
    base, adapters = folders
    changed = tmp_path / "qv-retrained"
    changed.mkdir()
    (changed / "adapter_config.json").write_text(
        (adapters["qv"] / "adapter_config.json").read_text()
    )
    tensors = safetensors.torch.load_file(str(adapters["qv"] / "adapter_model.safetensors"))
    safetensors.torch.save_file(
        {name: tensor * 1.5 for name, tensor in tensors.items()},
        str(changed / "adapter_model.safetensors"),
    )
    prefill = prefill_factory(
        model=str(base), lora_modules=(("qv", str(adapters["qv"])),), lease_ttl_s=2.0
    )
    # (decode's adapters, whether it loads on demand, the refusal)
    refusals = {
        "other weights": (
            {"qv": str(changed)},
            True,
            "computed this request's KV with LoRA weights .* LoRA adapter 'qv'",
        ),
        "no adapter, loading disallowed": (
            {},
            False,
            "unknown LoRA adapter 'qv'; this worker serves \\[\\] .* on demand",
        ),
    }
    for index, (modules, on_demand, refusal) in enumerate(refusals.values()):
        decode = make_decode_engine(
            "grpc", model=str(base), lora_modules=modules, load_lora_on_demand=on_demand
        )
        prompt = prompts_of(62 + index)[0]
        prefilled = prefill.prefill(
            f"x{index}", prompt, dataclasses.replace(GREEDY, max_tokens=1), "qv"
        )
        with pytest.raises(ValueError, match=refusal):
            decode.add_request(
                f"x{index}",
                prompt,
                GREEDY,
                kv_transfer_params=prefilled.kv_transfer_params,
                lora_name="qv",
                lora_path=str(adapters["qv"]),
            )
        assert_decode_idle(decode)
        decode.shutdown()
    prefill.wait_until_idle()  # the unclaimed leases expire: nothing is held
