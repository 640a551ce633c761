"""The static decode step (``engine/static_decode_batch.py``: persistent buffers, padded rows)
computes what the eager step computes.

Two runners share one model's weights, each with its own KV pages: one steps eagerly, the
other through the static buffers, its rows padded to the sizes CUDA graphs capture (on CPU
the engine does not pad: nothing replays); both are fed the same greedy tokens, so any
divergence shows as a different token. The function a CUDA graph captures
(``ModelRunner.padded_decode_forward``) is what the static runner calls here, directly.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.model_input import ScheduledChunk
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.static_decode_batch import StaticDecodeBatch, padded_sizes
from pdserve.model.loader import load_model
from tests.engine.hf_models import DECODE_FAMILIES, GEMMA3, save_hf_model
from tests.engine.host_sync_guard import HostSyncError, NoHostSync

BLOCK_SIZE = 4
NUM_BLOCKS = 256
MAX_ROWS = 8
MAX_POSITION = 200


def twin_runners(directory, config_class, overrides) -> tuple[ModelRunner, ModelRunner]:
    """An eager runner and a static one over the same weights."""
    save_hf_model(directory, config_class, **overrides)
    model, config, _ = load_model(str(directory))
    eager, static = (ModelRunner(model, config, NUM_BLOCKS, BLOCK_SIZE) for _ in range(2))
    for runner in (eager, static):
        runner.reserve_positions(MAX_POSITION)
    assert static.enable_static_decode(MAX_ROWS, 4, MAX_POSITION, pad_rows=True)
    return eager, static


class Tables:
    """Shuffled block tables per request and KV group; block 0, the null block, never."""

    def __init__(self, runner: ModelRunner, seed: int) -> None:
        self.free = list(range(1, runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.num_groups = len(runner.group_windows)
        self.tables: dict[str, list[list[int]]] = {}

    def chunk(self, name: str, tokens: list[int], start: int, drafts: int = 0) -> ScheduledChunk:
        tables = self.tables.setdefault(name, [[] for _ in range(self.num_groups)])
        for table in tables:
            while len(table) * BLOCK_SIZE < start + len(tokens):
                table.append(self.free.pop())
        first, *others = (list(table) for table in tables)
        return ScheduledChunk(
            name, list(tokens), start, first, True, False, tuple(others), num_draft_tokens=drafts
        )


def prefill_both(
    runners: tuple[ModelRunner, ModelRunner], lengths: list[int], seed: int
) -> tuple[list[list[int]], Tables]:
    """Prompts of ``lengths`` prefilled on both runners over the same tables; each sequence
    ends in its first greedy token."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 96) for _ in range(length)] for length in lengths]
    tables = Tables(runners[0], seed)
    chunks = [tables.chunk(str(i), prompt, 0) for i, prompt in enumerate(prompts)]
    firsts = [runner.execute(chunks).argmax(-1).tolist() for runner in runners]
    assert firsts[0] == firsts[1]
    return [prompt + [token] for prompt, token in zip(prompts, firsts[0])], tables


@pytest.mark.parametrize("config_class, overrides", DECODE_FAMILIES)
def test_static_decode_steps_equal_the_eager_steps_token_for_token(
    tmp_path, config_class, overrides
):
    """Three rows (padded to four) of different lengths, past Gemma's window of 12, for
    twenty greedy steps: the same tokens, the same logits but for float sums' order."""
    eager, static = twin_runners(tmp_path, config_class, overrides)
    sequences, tables = prefill_both((eager, static), [5, 17, 30], seed=1)
    streams: list[list[list[int]]] = [[list(s) for s in sequences] for _ in range(2)]
    for _ in range(20):
        chunks = [tables.chunk(str(i), s[-1:], len(s) - 1) for i, s in enumerate(streams[0])]
        assert static.static_decode is not None and static.static_decode.takes(chunks)
        logits = [runner.execute(chunks) for runner in (eager, static)]
        torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=0)
        for stream, step_logits in zip(streams, logits):
            for sequence, token in zip(stream, step_logits.argmax(-1).tolist()):
                sequence.append(token)
    assert streams[1] == streams[0]


@pytest.mark.parametrize("drafts", [[3, 3, 3], [3, 1, 0]], ids=["uniform", "mixed"])
@pytest.mark.parametrize("config_class, overrides", DECODE_FAMILIES[:3:2])
def test_verification_rows_of_a_token_and_its_drafts_equal_the_eager_step(
    tmp_path, config_class, overrides, drafts
):
    """Speculative verification: each row a last token and its drafts, every query's logits
    as the eager step's. Rows with fewer drafts than the step's most (drafting adapts per
    request) are padded to its queries per row (4: the graphs' size), their padding dropped."""
    eager, static = twin_runners(tmp_path, config_class, overrides)
    sequences, tables = prefill_both((eager, static), [9, 14, 21], seed=2)
    rng = random.Random(3)
    chunks = [
        tables.chunk(str(i), s[-1:] + [rng.randrange(2, 96) for _ in range(n)], len(s) - 1, n)
        for i, (s, n) in enumerate(zip(sequences, drafts))
    ]
    expected = eager.execute(chunks)
    got = static.execute(chunks)
    assert got.shape == expected.shape == (len(drafts) + sum(drafts), 96)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def llama_twins(tmp_path_factory) -> tuple[ModelRunner, ModelRunner]:
    return twin_runners(tmp_path_factory.mktemp("llama"), transformers.LlamaConfig, {})


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=MAX_ROWS),
    seed=st.integers(0, 2**16),
)
def test_padded_rows_never_change_a_real_row(llama_twins, lengths, seed):
    """Any batch, padded to its size: the real rows' logits are the eager step's, and every
    page but the null block's holds what the eager step wrote: padding reads and writes
    nothing of a request."""
    eager, static = llama_twins
    for runner in (eager, static):
        runner.kv_cache.zero_()
    sequences, tables = prefill_both((eager, static), lengths, seed)
    chunks = [tables.chunk(str(i), s[-1:], len(s) - 1) for i, s in enumerate(sequences)]
    expected, got = eager.execute(chunks), static.execute(chunks)
    assert got.shape[0] == len(chunks)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # Layer 1's K/V come from layer 0's rows, summed in another order at another batch size.
    torch.testing.assert_close(static.kv_cache[1:], eager.kv_cache[1:], atol=1e-5, rtol=0)


def test_steps_the_static_batch_does_not_take_run_eagerly(llama_twins):
    """A prefill chunk, more drafts than the buffers' queries, a LoRA row, more rows than
    the buffers hold, a row past the positions they cover, or a table too short: the eager
    step serves them (and raises its own clear error for the last), and ``takes`` says so."""
    _, static = llama_twins
    batch = static.static_decode
    assert batch is not None
    one = ScheduledChunk("a", [5], 7, [3, 4], True)
    assert batch.takes([one, ScheduledChunk("b", [5, 6], 6, [3, 4], True, num_draft_tokens=1)])
    assert not batch.takes([one, ScheduledChunk("c", [5, 6], 6, [3, 4], True)])
    five = ScheduledChunk("d", [5] * 5, 1, [3, 4], True, num_draft_tokens=4)
    assert not batch.takes([five])
    assert not batch.takes([ScheduledChunk("e", [5], 8, [3, 4], True)])
    assert not batch.takes([ScheduledChunk("f", [5], 7, [3, 4], True, lora_id="digest")])
    assert not batch.takes([one] * (MAX_ROWS + 1))
    assert not batch.takes([ScheduledChunk("g", [5], MAX_POSITION, list(range(1, 52)), True)])
    assert not batch.takes([ScheduledChunk("h", [5], 7, [3, 4], False)])


def test_padded_sizes_are_powers_of_two_then_steps_of_eight():
    assert padded_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert padded_sizes(12) == [1, 2, 4, 8, 12]
    assert padded_sizes(1) == [1]
    batch = StaticDecodeBatch(20, 1, 64, 4, 2, 2, [None], ((0, 0), (0, 1)), torch.device("cpu"))
    assert [batch.padded_size(n) for n in (1, 3, 5, 9, 17, 20)] == [1, 4, 8, 16, 20, 20]


@pytest.mark.parametrize("config_class, overrides", DECODE_FAMILIES)
def test_the_captured_forward_reads_nothing_on_the_host(tmp_path, config_class, overrides):
    """Once warm, the function a CUDA graph captures makes no host read (``.item``,
    ``.tolist``, ``.cpu``, a tensor's truth) and no tensor from host data or host sizes."""
    _, static = twin_runners(tmp_path, config_class, overrides)
    assert static.static_decode is not None
    static.static_decode.fill_padding(4, 1)
    static.padded_decode_forward(4, 1)  # warm: caches filled once, outside the guard
    with NoHostSync():
        hidden = static.padded_decode_forward(4, 1)
    assert hidden.shape == (4, 64)
    with pytest.raises(HostSyncError, match="tolist"), NoHostSync():
        hidden.argmax(-1).tolist()
    with pytest.raises(HostSyncError, match="torch.tensor"), NoHostSync():
        torch.tensor([1, 2])


def test_metadata_built_once_serves_every_later_step_as_a_replay_would(tmp_path):
    """A graph bakes in the tensors its capture saw; the static step's metadata must hold
    nothing a later step changes but through the buffers. Here the metadata of the first
    step is kept and handed to every later one (what a replay does): each later step with
    other rows, positions and tables still equals the eager step."""
    eager, static = twin_runners(tmp_path, transformers.Gemma3TextConfig, GEMMA3)
    batch = static.static_decode
    assert batch is not None
    sequences, tables = prefill_both((eager, static), [6, 11, 25, 3], seed=4)
    baked = {}
    build = batch.metadata

    def built_once(padded: int, queries: int):
        if (padded, queries) not in baked:
            baked[padded, queries] = build(padded, queries)
        return baked[padded, queries]

    batch.metadata = built_once  # type: ignore[method-assign]
    for step in range(12):
        rows = [(i, s) for i, s in enumerate(sequences) if (i + step) % 4 != 0]  # 3 rows of 4
        chunks = [tables.chunk(str(i), s[-1:], len(s) - 1) for i, s in rows]
        expected = eager.execute(chunks)
        torch.testing.assert_close(static.execute(chunks), expected, atol=1e-4, rtol=0)
        for (_, sequence), token in zip(rows, expected.argmax(-1).tolist()):
            sequence.append(token)
    assert list(baked) == [(4, 1)]
