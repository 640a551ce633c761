"""A model folder's generation_config.json fills the sampling fields a request leaves out
(vLLM's ``--generation-config auto``); a field the request sends, even at the API's default
value, is the request's; ``none`` and models without the file keep the API's defaults."""

from __future__ import annotations

import json
import types

import pytest
import transformers

from pdserve.gateway.api.chat import parse_chat
from pdserve.gateway.api.openai_schema import parse_completion
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.generation_defaults import sampling_defaults
from pdserve.gateway.orchestrator import RequestOrchestrator
from pdserve.messages.generation import ModelInfo
from pdserve.tokenizer.loading import load_tokenizer
from tests.engine.hf_models import save_hf_model

SHIPPED = {
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
    "min_p": 3.0,  # out of range: dropped
    "do_sample": True,
    "max_new_tokens": 512,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen-like")
    save_hf_model(path, transformers.LlamaConfig)
    (path / "generation_config.json").write_text(json.dumps({**SHIPPED, "eos_token_id": 1}))
    return path


def prepare(folder, defaults, body):
    pool = types.SimpleNamespace(prefill={"prefill-0": None}, decode={}, all={"prefill-0": None})
    config = GatewayConfig(model=str(folder), model_name="m")
    info = ModelInfo("m", 256, 16, "xxh3_128", 0, [1])
    tokenizer = load_tokenizer(str(folder))
    orchestrator = RequestOrchestrator(config, pool, info, tokenizer, defaults)  # type: ignore[arg-type]
    return orchestrator.prepare(parse_completion({"model": "m", "max_tokens": 4, **body}))[1]


def test_the_folders_defaults_are_read_and_a_bad_one_dropped(folder) -> None:
    assert sampling_defaults(str(folder)) == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }
    assert sampling_defaults("tiny") == {}


def test_defaults_fill_only_the_fields_a_request_leaves_out(folder) -> None:
    defaults = sampling_defaults(str(folder))
    params = prepare(folder, defaults, {"prompt": "w3 w4", "temperature": 1.0, "top_k": None})
    assert params.temperature == 1.0  # sent, at the API's own default: the request's
    assert (params.top_p, params.top_k, params.repetition_penalty) == (0.8, 20, 1.05)


def test_without_defaults_the_apis_own_hold(folder) -> None:
    params = prepare(folder, {}, {"prompt": "w3 w4"})
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)
    assert params.repetition_penalty == 1.0


def test_a_chat_reports_its_unset_fields_too(smollm2_gguf) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": 0.5}
    parsed = parse_chat(body, load_tokenizer("smollm2"))
    assert "top_p" not in parsed.unset_fields
    assert {"temperature", "top_k", "repetition_penalty"} <= parsed.unset_fields


def test_the_setting_refuses_another_value() -> None:
    with pytest.raises(ValueError, match="generation_config"):
        GatewayConfig(model="tiny", model_name="tiny", generation_config="vllm")  # type: ignore[arg-type]
