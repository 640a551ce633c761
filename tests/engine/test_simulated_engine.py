"""The simulated engine (``--model sim:<profile>``, ``model/sim_model.py``): the real
engine around a model that computes nothing, waits out its profile's forward and names
deterministic tokens; placeholder KV pages holding the real model's count of blocks. (The
hand-off between simulated workers: ``tests/kvconnector/test_simulated_handoff.py``.)"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from pdserve.checkpoint.model_source import resolve_model
from pdserve.checkpoint.sim_profiles import SimProfile, profile_names
from pdserve.engine.llm_engine import LLMEngine
from pdserve.messages.sampling_params import SamplingParams
from pdserve.model import sim_model
from pdserve.model.loader import check_model
from pdserve.model.sim_model import next_tokens

SIM = "sim:tiny-cpu"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 2, 17, 30, 4, 11] * 5, [6, 7, 8], list(range(40, 90))]


def expected_tokens(prompt: list[int], count: int, vocab_size: int, end_ids) -> list[int]:
    tokens = list(prompt)
    for _ in range(count):
        [token] = next_tokens(
            torch.tensor([tokens[-1]]), torch.tensor([len(tokens) - 1]), vocab_size, end_ids
        ).tolist()
        tokens.append(token)
    return tokens[len(prompt) :]


def test_profiles_resolve_and_an_unknown_one_is_named_with_the_others() -> None:
    assert "tiny-cpu" in profile_names() and "smollm2-cpu" in profile_names()
    source = resolve_model(SIM)
    assert source.kind == "sim" and source.stand_in.kind == "tiny"
    with pytest.raises(FileNotFoundError, match="'sim:nope' has no profile; the profiles are"):
        resolve_model("sim:nope")


def test_a_profile_file_of_ones_own_serves_by_its_path(tmp_path) -> None:
    """``sim:<path>.json``: a profile fitted on the machine at hand (sim_profiles' doc)."""
    fields = dataclasses.asdict(resolve_model(SIM).profile)
    del fields["name"]
    path = tmp_path / "here-cpu.json"
    path.write_text(json.dumps({**fields, "step_s": 0.25}))
    engine = LLMEngine.from_pretrained(f"sim:{path}", num_kv_blocks=64)
    assert engine.runner.model.profile.name == "here-cpu"
    assert engine.runner.model.profile.step_s == 0.25
    assert engine.model_config.weights_digest.startswith("sim:here-cpu:")
    with pytest.raises(FileNotFoundError, match="or sim:<path>.json for a profile file"):
        resolve_model(f"sim:{tmp_path / 'absent.json'}")
    del fields["device"]  # a profile written before profiles said where they were timed
    path.write_text(json.dumps(fields))
    with pytest.raises(ValueError, match="must hold one JSON object of the fields stands_for, "):
        resolve_model(f"sim:{path}")


@pytest.mark.parametrize(
    "sampling", [{}, {"temperature": 0.9, "seed": 3}], ids=["greedy", "seeded"]
)
def test_a_simulated_engine_names_the_same_tokens_every_time(sampling) -> None:
    engine = LLMEngine.from_pretrained(SIM, num_kv_blocks=64)
    params = dataclasses.replace(GREEDY, **sampling)
    end_ids = engine.runner.model._end_ids
    outputs = engine.generate(PROMPTS, params)
    for prompt, output in zip(PROMPTS, outputs):
        want = expected_tokens(prompt, 12, engine.runner.model.vocab_size, end_ids)
        assert output.output_token_ids == want
    again = engine.generate(PROMPTS, params)  # from the prefix cache this time
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in outputs]
    assert engine.stats().prefix_cache_hits > 0


def test_pages_are_placeholders_holding_the_real_models_count_of_blocks() -> None:
    budget = 8 << 20
    real = LLMEngine.from_pretrained("tiny", kv_cache_memory_bytes=budget)
    simulated = LLMEngine.from_pretrained(SIM, kv_cache_memory_bytes=budget)
    assert simulated.runner.num_blocks == real.runner.num_blocks
    assert simulated.runner.kv_cache.numel() * 16 < real.runner.kv_cache.numel()


def profile_of(device: str, seconds: float) -> SimProfile:
    """A profile whose every forward takes about ``seconds`` (plus 1 ms a token)."""
    return SimProfile("slow", "tiny", device, seconds, 0.001, 0.0, 0.0, 1.0, measured="")


def test_a_cuda_profiles_forward_sleeps_out_the_profiles_time(monkeypatch) -> None:
    """The wait asked for is the profile's seconds for these tokens (less what the forward
    itself took): checked on the call, not on a clock."""
    profile = SimProfile("slow", "tiny", "cuda", 0.5, 0.01, 0.02, 0.001, 1.0, measured="")
    engine = LLMEngine.from_pretrained(SIM, num_kv_blocks=64)
    engine.runner.model.profile = engine.runner.model.dilated = profile
    waits: list[float] = []
    monkeypatch.setattr(sim_model, "sleep", waits.append)
    engine.generate([[1, 2, 3, 4]], dataclasses.replace(GREEDY, max_tokens=2))
    prefill, decode = profile.forward_seconds(4, 10), profile.forward_seconds(1, 5)
    assert prefill - 0.05 < waits[0] <= prefill and decode - 0.05 < waits[1] <= decode


@pytest.mark.parametrize("time_scale", [1.0, 4.0])
def test_a_cpu_profiles_forward_spends_its_time_on_a_core(time_scale, monkeypatch) -> None:
    """A CPU profile's forward occupies a core as its real one would (sim_model's doc): the
    thread's CPU time grows by at least the profile's seconds a forward, whatever the
    clock's dilation, and the forward waits out the rest of the dilated time; a CUDA
    profile's forward spends almost none of it and waits it all out."""
    stands_for = check_model("tiny")
    seconds = profile_of("cpu", 0.05).forward_seconds(2, 3)
    waits: list[float] = []
    monkeypatch.setattr(sim_model, "sleep", waits.append)
    spent = {}
    for device in ("cpu", "cuda"):
        model = sim_model.SimulatedCausalLM(profile_of(device, 0.05), stands_for, time_scale)
        ids, positions = torch.tensor([3, 4]), torch.tensor([0, 1])
        began = time.thread_time()
        for _ in range(3):
            model(ids, positions, None, None)
        spent[device] = (time.thread_time() - began) / 3
    assert seconds <= spent["cpu"] < seconds + 0.02
    assert spent["cuda"] < 0.01
    cpu_waits, cuda_waits = waits[:3], waits[3:]
    dilated = time_scale * seconds
    # Less what the forward took on the wall clock besides: 50 ms of slack for a busy host.
    assert all(dilated - seconds - 0.05 < wait <= dilated - seconds for wait in cpu_waits)
    assert all(dilated - 0.05 < wait <= dilated for wait in cuda_waits)


def test_a_dilated_clock_stretches_every_forward_and_hand_off() -> None:
    """``sim_time_scale`` k: the engine's forwards take k times the profile's time and its
    hand-offs move the real pages at 1/k the rate (time dilation, sim_profiles' doc)."""
    from pdserve.messages.engine_config import EngineConfig
    from pdserve.model.sim_transfer import simulated_transfer

    profile = resolve_model(SIM).profile
    engine = LLMEngine.from_pretrained(SIM, num_kv_blocks=64, sim_time_scale=3.0)
    assert engine.runner.model.profile == profile
    slowed = engine.runner.model.dilated
    for tokens, kv_tokens in [(1, 1), (1, 900), (37, 700), (512, 131_328)]:
        want = 3.0 * profile.forward_seconds(tokens, kv_tokens)
        assert slowed.forward_seconds(tokens, kv_tokens) == pytest.approx(want)
    plain = simulated_transfer(EngineConfig(model=SIM))
    dilated = simulated_transfer(EngineConfig(model=SIM, sim_time_scale=3.0))
    assert dilated.bytes_per_s == pytest.approx(plain.bytes_per_s / 3.0)
    assert dilated.page_bytes == plain.page_bytes
    assert profile.slowed(1.0) is profile
    outputs = engine.generate(PROMPTS, GREEDY)  # the tokens do not depend on the clock
    end_ids = engine.runner.model._end_ids
    for prompt, output in zip(PROMPTS, outputs):
        assert output.output_token_ids == expected_tokens(
            prompt, 12, engine.runner.model.vocab_size, end_ids
        )


def test_what_a_simulated_model_cannot_do_is_refused() -> None:
    with pytest.raises(ValueError, match="runs at tensor_parallel_size 1"):
        LLMEngine.from_pretrained(SIM, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="sim_time_scale must be positive, got 0"):
        LLMEngine.from_pretrained(SIM, sim_time_scale=0.0)
    with pytest.raises(ValueError, match="slows a simulated model's clock; tiny is a real"):
        LLMEngine.from_pretrained("tiny", sim_time_scale=2.0)
    with pytest.raises(ValueError, match="'sim:slow': device must be one of cpu, cuda, got 'tpu'"):
        profile_of("tpu", 0.1)
