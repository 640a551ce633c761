"""An engine of tensor-parallel degree 2 or 4 (rank 0 plus spawned peer processes over a real
gloo group on 127.0.0.1, sharing the KV pages) gives TP=1's outputs exactly: greedy and
seeded tokens, logprobs, prefix hits and chunked prefills beside running decodes; and a
rank that dies fails the engine at once, naming it, with no process left behind.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import transformers

from pdserve.engine import tensor_parallel_peers
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tensor_parallel_peers import TensorParallelGroupLost
from pdserve.kvconnector.pd.pd_connector import PDConnector
from pdserve.kvconnector.tier.tier_connector import TierConnector
from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.kv_tier_config import KVTierConfig
from pdserve.messages.sampling_params import SamplingParams
from tests.engine.hf_models import save_hf_model

# Two prompts sharing three blocks (the second is a prefix hit on the first's pages), and
# one long enough that its prefill is chunked beside the others' decodes.
SHARED = list(range(3, 51))
PROMPTS = [SHARED + [60, 61, 62], SHARED + [70, 71], [(7 * i) % 90 + 2 for i in range(120)]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen2_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2 (biased q/k/v, 4 query heads sharing 2 KV heads)."""
    directory = tmp_path_factory.mktemp("qwen2")
    save_hf_model(directory, transformers.Qwen2Config)
    return directory


def _outputs(engine: LLMEngine) -> list[tuple[list[int], list, int]]:
    """Greedy (with logprobs) then seeded, prompt by prompt, in one engine: the later
    prompts hit the earlier ones' cached blocks."""
    results = []
    for params in (GREEDY, SEEDED):
        for output in engine.generate(PROMPTS, params):
            results.append(
                (output.output_token_ids, output.output_logprobs, output.num_cached_tokens)
            )
    return results


def _engine(model: str, tensor_parallel_size: int) -> LLMEngine:
    return LLMEngine.from_pretrained(
        model,
        num_kv_blocks=48,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=32,
        tensor_parallel_size=tensor_parallel_size,
    )


@pytest.mark.parametrize("tensor_parallel_size", [2, 4], ids=["tp2-kv-split", "tp4-kv-replicated"])
@pytest.mark.parametrize("kind", ["tiny", "qwen2"])
def test_a_tensor_parallel_engine_gives_a_single_process_engines_outputs(
    kind: str, tensor_parallel_size: int, request: pytest.FixtureRequest
) -> None:
    model = "tiny" if kind == "tiny" else str(request.getfixturevalue("qwen2_directory"))
    single = _engine(model, 1)
    expected = _outputs(single)
    single.shutdown()
    engine = _engine(model, tensor_parallel_size)
    try:
        assert len(engine.runner.peers.pids) == tensor_parallel_size - 1
        outputs = _outputs(engine)
    finally:
        engine.shutdown()
    assert [tokens for tokens, _, _ in outputs] == [tokens for tokens, _, _ in expected]
    assert [cached for _, _, cached in outputs] == [cached for _, _, cached in expected]
    assert any(cached > 0 for _, _, cached in outputs)  # the prefix hit happened
    for (_, logprobs, _), (_, expected_logprobs, _) in zip(outputs, expected):
        for got, want in zip(logprobs, expected_logprobs):
            if want is None:
                assert got is None
                continue
            assert got.token_id == want.token_id
            assert [token for token, _ in got.top] == [token for token, _ in want.top]
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)


def test_a_tensor_parallel_engine_loads_evicted_prefixes_back_from_a_kv_tier() -> None:
    """The tier stores and loads whole pages of the shared KV tensor (every rank's heads),
    so a TP=2 engine whose pool holds one request at a time, four system prompts taking
    turns, gives the tokens of a TP=1 engine without a tier."""
    rng = random.Random(0)
    systems = [[rng.randrange(2, 500) for _ in range(64)] for _ in range(4)]
    prompts = [systems[i % 4] + [rng.randrange(2, 500) for _ in range(8)] for i in range(8)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    kwargs = dict(num_kv_blocks=12, max_num_seqs=1, max_num_batched_tokens=32)
    plain = LLMEngine.from_pretrained("tiny", **kwargs)
    expected = [plain.generate([prompt], params)[0].output_token_ids for prompt in prompts]
    tier = TierConnector(KVTierConfig(cpu_bytes=1 << 22), "worker-0")
    engine = LLMEngine.from_pretrained("tiny", connector=tier, tensor_parallel_size=2, **kwargs)
    try:
        assert [engine.generate([p], params)[0].output_token_ids for p in prompts] == expected
        (stats,) = engine.stats().tiers
    finally:
        engine.shutdown()
    assert stats.blocks_loaded == 4 * 4 and stats.load_failures == 0  # 4 system blocks, 4 times


def test_a_connector_that_fails_to_shut_down_leaves_no_rank_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tier = TierConnector(KVTierConfig(cpu_bytes=1 << 22), "worker-0")
    engine = LLMEngine.from_pretrained("tiny", connector=tier, tensor_parallel_size=2)
    (peer,) = engine.runner.peers.pids

    def fail() -> None:  # stands in for a connector whose stop raises
        raise RuntimeError("the connector failed to stop")

    monkeypatch.setattr(tier, "shutdown", fail)
    with pytest.raises(RuntimeError, match="failed to stop"):
        engine.shutdown()
    with pytest.raises(ProcessLookupError):
        os.kill(peer, 0)


def test_a_group_that_fails_to_form_leaves_no_rank_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:  # stands in for rank 0 failing to join the group
        raise RuntimeError("the group did not form")

    monkeypatch.setattr(tensor_parallel_peers, "join_group", fail)
    before = {child.pid for child in multiprocessing.active_children()}
    with pytest.raises(RuntimeError, match="did not form"):
        LLMEngine.from_pretrained("tiny", num_kv_blocks=32, tensor_parallel_size=2)
    assert {child.pid for child in multiprocessing.active_children()} == before


def test_a_rank_that_dies_before_joining_fails_the_start_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A peer whose interpreter ends as it starts (here a ``sitecustomize`` on its path exits
    with 3, as an import that fails or an OOM kill would end it) never joins the group: rank
    0's join used to wait out the group's 60 s timeout, then blame the timeout."""
    (tmp_path / "sitecustomize.py").write_text("import os\nos._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    joined = []
    join_group = tensor_parallel_peers.join_group

    def join_and_record(*args: Any) -> Any:  # the real join, recorded
        joined.append(args[1])
        return join_group(*args)

    monkeypatch.setattr(tensor_parallel_peers, "join_group", join_and_record)
    before = {child.pid for child in multiprocessing.active_children()}
    with pytest.raises(
        TensorParallelGroupLost, match=r"rank 1 failed to start: pid \d+ exited with 3"
    ):
        LLMEngine.from_pretrained("tiny", num_kv_blocks=32, tensor_parallel_size=2)
    assert not joined  # refused before rank 0 began to join
    assert {child.pid for child in multiprocessing.active_children()} == before


def test_a_rank_that_dies_after_saying_it_joins_fails_the_start_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A peer that dies after telling rank 0 it joins (here its join exits with 4, as a kill
    or an OOM there would end it) left rank 0's join to wait out gloo's 60 s timeout."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os\n"
        "from pdserve.engine import tensor_parallel_peers\n"
        "def _die(*args):\n"
        "    os._exit(4)\n"
        "tensor_parallel_peers.join_group = _die\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    before = {child.pid for child in multiprocessing.active_children()}
    started = time.monotonic()
    with pytest.raises(
        TensorParallelGroupLost, match=r"did not form: rank 1 \(pid \d+\) exited with 4"
    ):
        LLMEngine.from_pretrained("tiny", num_kv_blocks=32, tensor_parallel_size=2)
    assert time.monotonic() - started < 30  # not gloo's 60 s
    assert {child.pid for child in multiprocessing.active_children()} == before


def test_a_rank_that_dies_fails_the_engine_naming_it_and_leaves_no_process() -> None:
    lost = threading.Event()
    engine = LLMEngine(
        EngineConfig(model="tiny", num_kv_blocks=32, tensor_parallel_size=2), on_rank_lost=lost.set
    )
    (peer,) = engine.runner.peers.pids
    try:
        engine.generate([PROMPTS[0]], SamplingParams(max_tokens=2))  # the group works
        os.kill(peer, signal.SIGKILL)
        assert lost.wait(30), "the watchdog did not report the dead rank"
        engine.add_request("after", PROMPTS[1], SamplingParams(max_tokens=2))
        with pytest.raises(TensorParallelGroupLost, match=r"rank 1 \(pid \d+\) exited with -9"):
            engine.step()
    finally:
        engine.shutdown()
    with pytest.raises(ProcessLookupError):
        os.kill(peer, 0)


def test_an_engine_that_fails_after_its_ranks_started_leaves_no_rank_behind() -> None:
    """The ranks start with the runner; a later part that refuses (here the connector: its
    hash seed is no integer) used to leave them running, each with a copy of the model."""
    connector = PDConnector(
        KVConnectorConfig(role="producer", allow_insecure=True),
        engine_id="prefill-0",
        hash_algorithm="xxh3_128",
        hash_seed="not-an-integer",
    )
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="integer hash_seed"):
        LLMEngine.from_pretrained(
            "tiny", connector=connector, num_kv_blocks=32, tensor_parallel_size=2
        )
    assert not set(multiprocessing.active_children()) - before


def test_a_step_interrupted_on_rank_0_leaves_the_group_refusing_at_once(monkeypatch) -> None:
    """A KeyboardInterrupt in rank 0's forward (Ctrl-C in a notebook) leaves rank 1 inside
    that step's collectives: a next step would pair with them (it stalled 60 s, then blamed
    rank 0's timeout). The interrupt stays an interrupt; the next step is refused at once,
    naming it; shutdown reaps the rank."""
    engine = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=32, tensor_parallel_size=2))
    (peer,) = engine.runner.peers.pids
    forward = engine.runner._forward

    def interrupted(*args):
        monkeypatch.setattr(engine.runner, "_forward", forward)
        raise KeyboardInterrupt

    try:
        monkeypatch.setattr(engine.runner, "_forward", interrupted)
        engine.add_request("r0", PROMPTS[0], SamplingParams(max_tokens=2))
        with pytest.raises(KeyboardInterrupt):
            engine.step()
        engine.abort_all()  # what a caller does after a step that raised
        engine.add_request("r1", PROMPTS[1], SamplingParams(max_tokens=2))
        with pytest.raises(
            TensorParallelGroupLost, match="rank 0's step failed: KeyboardInterrupt"
        ):
            engine.step()
    finally:
        engine.shutdown()
    with pytest.raises(ProcessLookupError):
        os.kill(peer, 0)


def test_tensor_parallelism_off_the_cpu_is_refused_naming_why() -> None:
    with pytest.raises(ValueError, match="run on CPU only for now"):
        LLMEngine.from_pretrained("tiny", device="meta", tensor_parallel_size=2)
