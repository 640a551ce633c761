"""``pdserve up``'s checks: a port whose server just stopped is free, a listened one is not;
what a worker would refuse (a missing or unsupported model, a GGUF weight type, a split the
heads do not allow, a draft of another vocabulary, a bad setting) is named with what is
supported before anything starts, by ``up`` and by ``scale``. No Ray: ``init_ray`` and
``deploy`` fail the test if they are reached.

The TIME_WAIT is real: a server on 127.0.0.1 accepts a connection and closes it first (the
side that closes first keeps the TIME_WAIT), then stops listening, as a stopped
``pdserve up`` leaves its HTTP port. Before the fix the probe bound without ``SO_REUSEADDR``
and reported that port "in use" for a minute.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Any

import pytest
from gguf import GGMLQuantizationType as Quant

from pdserve.deploy import cli, cluster
from pdserve.deploy.config import PDServeConfig
from pdserve.deploy.preflight import _is_free, preflight_problems
from tests.deploy.small_gguf import TOKENS, write_small_gguf, write_sparse_gguf
from tests.ports import free_port

# An existing cluster's address: the checks probe no port (the app's ports are elsewhere).
JOINED = "127.0.0.1:6390"


def test_a_port_left_in_time_wait_is_free_and_a_listened_port_is_not() -> None:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        assert not _is_free("127.0.0.1", port)  # something listens
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            accepted.close()  # the server side closes first: its port enters TIME_WAIT
            client.recv(1)
    with socket.socket() as plain_probe:  # what the old probe saw
        try:
            plain_probe.bind(("127.0.0.1", port))
            time_wait_refused_a_plain_bind = False
        except OSError:
            time_wait_refused_a_plain_bind = True
    assert time_wait_refused_a_plain_bind, "no TIME_WAIT was left: the test proves nothing"
    assert _is_free("127.0.0.1", port)


def test_a_missing_draft_model_is_named_before_anything_starts(tmp_path) -> None:
    config = PDServeConfig.model_validate(
        {
            "speculative_method": "draft_model",
            "speculative_model": str(tmp_path / "no-draft"),
            "ray_address": JOINED,
        }
    )
    [problem] = preflight_problems(config)
    assert problem.startswith(f"--speculative-model '{tmp_path / 'no-draft'}'")


def refusals(**fields: Any) -> list[str]:
    return preflight_problems(PDServeConfig.model_validate({"ray_address": JOINED, **fields}))


@pytest.fixture
def nothing_deploys(monkeypatch) -> None:
    """Reaching Ray fails the test: the refusal must come before anything is deployed."""

    def deployed(*args: object, **kwargs: object) -> None:
        raise AssertionError("a refused config reached Ray")

    monkeypatch.setattr(cluster, "init_ray", deployed)
    monkeypatch.setattr(cluster, "deploy", deployed)


def test_pdserve_up_refuses_a_gguf_of_an_unsupported_architecture_before_deploying(
    tmp_path, nothing_deploys, capsys
) -> None:
    """The report: a Gemma 3 GGUF (not supported then) was listed, answered 503 for 33-48 s,
    then failed with "Failed to update the deployments"; the reason was only in a worker's
    log."""
    phi3 = write_small_gguf(tmp_path / "phi-3-mini.gguf", architecture="phi3")
    assert cli.main(["up", "--model", str(phi3), "--address", JOINED]) == 2
    assert capsys.readouterr().err == (
        "pdserve up: this config cannot start:\n"
        f"  - --model '{phi3}': GGUF architecture 'phi3' is not supported; "
        "supported: llama, qwen2, qwen3, gemma3, qwen3moe, deepseek2\n"
    )


def test_a_gguf_weight_type_the_loader_cannot_dequantize_is_refused_naming_those_it_can(
    tmp_path,
) -> None:
    mxfp4 = write_small_gguf(tmp_path / "mxfp4.gguf", weight_type=Quant.MXFP4)
    [problem] = refusals(model=str(mxfp4))
    assert problem.startswith(
        f"--model '{mxfp4}': GGUF tensor 'token_embd.weight' is quantized as MXFP4, which is "
        "not supported; supported: BF16, F16, F32, Q2_K"
    )


def test_a_split_the_heads_do_not_allow_is_refused_naming_the_degrees_that_fit() -> None:
    """tiny has 4 query heads over 2 KV heads: a worker of degree 3 failed as it sharded."""
    assert refusals(model="tiny", decode_tensor_parallel_size=3) == [
        "--decode-tensor-parallel-size 3: tensor parallel size 3 does not divide the model's "
        "4 attention heads; supported for this model: 1, 2, 4"
    ]


def test_a_draft_model_of_another_vocabulary_is_refused(tmp_path) -> None:
    draft = write_small_gguf(tmp_path / "draft.gguf")
    assert refusals(
        model="tiny", speculative_method="draft_model", speculative_model=str(draft)
    ) == [
        f"--speculative-model '{draft}': speculative_model {draft} has a vocabulary of "
        f"{len(TOKENS)} tokens and the model tiny one of 512: a draft model must share the "
        "model's tokenizer"
    ]


def test_a_model_every_check_accepts_passes(tmp_path) -> None:
    """The checks refuse only what a worker refuses: a llama GGUF split in two is served."""
    llama = write_small_gguf(tmp_path / "llama.gguf")
    assert refusals(model=str(llama), prefill_tensor_parallel_size=2) == []


def test_pdserve_up_names_a_bad_setting_and_what_it_accepts_without_a_traceback(
    tmp_path, nothing_deploys, capsys
) -> None:
    """A ``--config`` value pydantic refuses was a ValidationError traceback."""
    settings = tmp_path / "app.yaml"
    settings.write_text("kv_cache_dtype: int8\nprefill_tensor_parallel_size: 0\n")
    assert cli.main(["up", "--config", str(settings)]) == 2
    error = capsys.readouterr().err
    assert (
        "--kv-cache-dtype 'int8': Input should be 'auto', 'float32', 'bfloat16' or 'float16'"
        in error
    )
    assert "--prefill-tensor-parallel-size 0: Input should be greater than or equal to 1" in error
    assert "Traceback" not in error


def test_pdserve_scale_refuses_what_a_new_worker_would_refuse_before_deploying(
    tmp_path, nothing_deploys, monkeypatch
) -> None:
    """The app's model file went away since ``up``: the scale step is refused, naming it,
    and nothing is redeployed."""
    from ray.experimental import internal_kv

    model = write_small_gguf(tmp_path / "llama.gguf")
    running = PDServeConfig.model_validate({"model": str(model), "ray_address": JOINED})
    monkeypatch.setattr(
        internal_kv, "_internal_kv_get", lambda key: running.model_dump_json().encode()
    )
    model.unlink()
    with pytest.raises(ValueError, match=f"--model '{model}': model '{model}' is neither"):
        cluster.scale(running.app_name, 2, 1)


def test_a_model_whose_weights_do_not_fit_this_machine_is_refused_naming_both_numbers(
    tmp_path,
) -> None:
    """A 7B-shaped Q4_0 GGUF (Llama 2 7B's widths with 8 KV heads, 5.8 B weights, tensor
    bytes a hole in a sparse file): dequantized to float32 one worker needs ≈ 22 GiB, so workers enough to pass this
    machine's memory (two on a 24 GiB one) are refused
    by ``pdserve up`` before it deploys; kept packed (``--quantization auto``) the
    weights take ≈ 3.0 GiB and it passes."""
    seven_b = write_sparse_gguf(
        tmp_path / "llama-7b-q4_0.gguf",
        num_layers=32,
        hidden=4096,
        intermediate=11008,
        vocab=32000,
        weight_type=Quant.Q4_0,
    )
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    workers = max(2, machine // (21 * 2**30) + 1)  # more float32 copies than it holds
    embedded = dict(model=str(seven_b), num_prefill=1, num_decode=workers - 1, port=free_port())
    [problem] = preflight_problems(
        PDServeConfig.model_validate({**embedded, "quantization": "none"})
    )
    assert re.fullmatch(
        rf"--model '{seven_b}': {workers} workers need \d+\.\d GiB \(each: weights 2[12]\.\d\d GiB as "
        r"--quantization none runs them in float32, plus a KV pool of 0\.25 GiB\), and this "
        r"machine has \d+\.\d GiB: .*",
        problem,
    ), problem
    assert (
        preflight_problems(PDServeConfig.model_validate({**embedded, "quantization": "auto"})) == []
    )


def test_lora_adapters_a_worker_would_refuse_are_named_before_deploying(tmp_path) -> None:
    """tiny's layer 0 q_proj under a rank-32 adapter (max_lora_rank 16), and a folder that is
    not there: each named with its flag; a fitting adapter passes."""
    from tests.engine.test_lora import write_q_proj_adapter

    wide = write_q_proj_adapter(tmp_path / "wide", layer=0, rank=32, width=256)
    fits = write_q_proj_adapter(tmp_path / "fits", layer=0, rank=4, width=256)
    missing = tmp_path / "missing"
    problems = refusals(
        model="tiny", lora_modules={"wide": wide, "gone": str(missing), "fits": fits}
    )
    assert problems == [
        f"--lora-modules wide={wide}: LoRA adapter 'wide' has rank 32 at q_proj of layer 0, "
        "above max_lora_rank 16",
        f"--lora-modules gone={missing}: LoRA adapter 'gone' at {missing} cannot be read: "
        f"[Errno 2] No such file or directory: '{missing / 'adapter_config.json'}'",
    ]


def test_a_simulated_model_passes_and_what_it_cannot_do_is_named() -> None:
    assert refusals(model="sim:smollm2-cpu", num_prefill=4, num_decode=4) == []
    [unknown] = refusals(model="sim:nope")
    assert unknown.startswith("--model 'sim:nope': simulated model 'sim:nope' has no profile")
    [split] = refusals(model="sim:tiny-cpu", decode_tensor_parallel_size=2)
    assert split.startswith("--decode-tensor-parallel-size: a simulated model (sim:tiny-cpu)")
