"""The gateway's pure parts: request validation, stop-string hold-back, the worker event log."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.cache import BlockRemoved, BlockStored
from pdserve.gateway.api.chat import parse_chat
from pdserve.gateway.api.openai_schema import APIError, parse_completion
from pdserve.gateway.grpc_ingress import GenerateServicer
from pdserve.gateway.router import Router
from pdserve.gateway.worker_pool import WorkerPool
from pdserve.proto import generate_pb2
from pdserve.tokenizer.detokenizer import stop_safe_length
from pdserve.tokenizer.tokenizer import ByteTokenizer
from pdserve.worker.kv_event_log import KVEventLog


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "tiny"}, "prompt"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"model": "tiny", "prompt": "hi", "temperature": -0.5}, "temperature"),
        ({"model": "tiny", "prompt": "hi", "temperature": 9}, "temperature"),
        ({"model": "tiny", "prompt": "hi", "top_p": 0}, "top_p"),
        ({"model": "tiny", "prompt": ""}, "prompt"),
        ({"model": "tiny", "prompt": [1, -2]}, "prompt"),
        ({"prompt": "hi"}, "model"),
        ([1, 2], None),
    ],
)
def test_bad_completion_requests_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as caught:
        parse_completion(body)
    assert caught.value.status == 400
    assert caught.value.body()["error"]["param"] == param
    assert caught.value.body()["error"]["message"]


def test_a_completion_request_accepts_text_token_ids_and_a_single_prompt_list():
    assert parse_completion({"model": "m", "prompt": "abc"}).prompt_text == "abc"
    assert parse_completion({"model": "m", "prompt": [5, 6]}).prompt_token_ids == [5, 6]
    parsed = parse_completion(
        {"model": "m", "prompt": ["abc"], "stop": "x", "seed": 3, "max_tokens": 4, "temperature": 0}
    )
    assert (parsed.prompt_text, parsed.params.stop, parsed.params.seed) == ("abc", ["x"], 3)
    assert parsed.params.greedy and parsed.params.max_tokens == 4


def test_text_that_may_begin_a_stop_string_is_held_back():
    assert stop_safe_length("hello wor", ["world"]) == len("hello ")
    assert stop_safe_length("hello", ["xyz"]) == 5
    assert stop_safe_length("ab", []) == 2


def _stored(*hashes: bytes) -> BlockStored:
    return BlockStored(list(hashes), None, [], 16, None)


def test_the_event_log_serves_cursors_and_snapshots_after_truncation():
    log = KVEventLog("p0", "inst", max_bytes=200)  # two one-hash events (97 bytes each)
    log.extend([_stored(b"a"), _stored(b"b")])
    assert [e.block_hashes for e in log.since(1).events] == [[b"b"]]
    log.extend([BlockRemoved([b"a"])])  # drops event 0 from the log
    late = log.since(0)
    assert late.snapshot.groups[0].hashes == {b"b"} and late.first_seq == late.next_seq == 3
    router = Router(["p0"], [])
    router.apply(late)
    assert router.pick_prefill([b"b"]).num_matched_blocks == 1


def test_vllms_stop_token_ids_and_top_k_minus_one_are_served():
    parsed = parse_completion({"model": "m", "prompt": "hi", "stop_token_ids": [3, 5], "top_k": -1})
    assert parsed.params.stop_token_ids == [3, 5] and parsed.params.top_k == 0
    with pytest.raises(APIError) as refused:
        parse_completion({"model": "m", "prompt": "hi", "stop_token_ids": [-1]})
    assert refused.value.param == "stop_token_ids"


@pytest.mark.parametrize("field, value", [("echo", True), ("best_of", 2)])
def test_chat_refuses_fields_that_would_change_its_reply(field, value):
    """vLLM's chat ``echo`` begins the reply with the last message; both were ignored."""
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "m", "messages": messages, field: value}
    with pytest.raises(APIError) as refused:
        parse_chat(body, ByteTokenizer())
    assert refused.value.status == 400 and refused.value.param == field
    parse_chat({**body, field: {"echo": False, "best_of": 1}[field]}, ByteTokenizer())


def test_a_grpc_chat_without_max_tokens_may_run_to_the_end_of_the_context_as_over_http():
    """A gRPC chat's ``max_tokens = 0`` was 16; a completion's stays 16 (the proto's word).
    The servicer's parse needs only the served model's name and tokenizer: a plain object
    stands in for the orchestrator (a real one needs the Ray app; running such a chat there
    would decode thousands of tokens)."""
    orchestrator = SimpleNamespace(model_name="tiny", tokenizer=ByteTokenizer())
    servicer = GenerateServicer(orchestrator)  # type: ignore[arg-type]
    chat = generate_pb2.GenerateRequest()
    chat.chat.messages.add(role="user", content="hi")
    assert servicer._parse(chat).max_tokens_to_context
    chat.max_tokens = 5
    parsed = servicer._parse(chat)
    assert not parsed.max_tokens_to_context and parsed.params.max_tokens == 5
    text = servicer._parse(generate_pb2.GenerateRequest(text="hi"))
    assert not text.max_tokens_to_context and text.params.max_tokens == 16


def test_a_pool_reshaped_by_a_scale_step_routes_the_new_set_and_still_reaches_the_retired():
    """``WorkerPool.reshape`` (``Gateway.reconfigure``): kept workers keep their handle; a
    retired one is polled and routed no more, yet the requests already there still reach
    it (a stream's end, an abort) until the next step drops it."""
    handles = {w: SimpleNamespace(name=w) for w in ("p0", "p1", "d0", "d1")}
    pool = WorkerPool({"p0": handles["p0"]}, {"d0": handles["d0"]})
    change = pool.reshape(
        {"p0": handles["p0"], "p1": handles["p1"]}, {"d1": handles["d1"]}, {"d0": handles["d0"]}
    )
    assert (change.added_prefill, change.added_decode, change.removed) == (["p1"], ["d1"], ["d0"])
    assert list(pool.all) == ["p0", "p1", "d1"]
    assert pool.handle("d0") is handles["d0"] and pool.role("d0") == "decode"
    pool.reshape({"p0": handles["p0"], "p1": handles["p1"]}, {"d1": handles["d1"]}, {})
    with pytest.raises(KeyError, match="d0"):
        pool.handle("d0")
