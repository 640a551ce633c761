"""Random interleavings of admit / chunked prefill / decode / external load / free / evict /
reset / pin (a lease offering a prefilling request's blocks) / unpin over many requests with
shared prefixes and a small pool, checking the ledger's invariants after every step against
a shadow of what each block holds."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.cache import get_block_hash
from tests.cache.cache_fakes import BLOCK_SIZE, FakeRequest, make_hasher, make_manager

PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5] * 10]
HASHER = make_hasher()
MAX_MODEL_LEN = 40


class LedgerMachine(RuleBasedStateMachine):
    sliding_window: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.manager = make_manager(
            num_blocks=12, sliding_window=self.sliding_window, max_model_len=MAX_MODEL_LEN
        )
        self.pool = self.manager.block_pool
        self.waiting: dict[str, FakeRequest] = {}
        self.running: dict[str, FakeRequest] = {}
        self.shadow: dict[int, list[int | None]] = {}  # block id -> tokens written into it
        self.hash_tokens: dict[bytes, tuple[int, ...]] = {}  # block hash -> its block's tokens
        # Free blocks whose hash an explicit evict / reset dropped: they stay where they sat.
        self.unhashed_in_place: set[int] = set()
        # Owner -> its pinned blocks and what each held when pinned (a lease vouches for it).
        self.pinned: dict[str, dict[int, list[int | None]]] = {}
        # Blocks a later pin left out (a reference each time): a read may still copy them.
        self.retired: dict[str, list[tuple[int, list[int | None]]]] = {}
        self.next_id = 0

    # helpers

    def _record_hashes(self, req: FakeRequest) -> None:
        for index, block_hash in enumerate(req.block_hashes):
            tokens = tuple(req.all_token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])
            assert self.hash_tokens.setdefault(block_hash, tokens) == tokens

    def _held_by_others(self, request_id: str) -> set[int]:
        return {
            block_id
            for other_id in self.running
            if other_id != request_id
            for table in self.manager.get_block_ids(self.running[other_id])
            for block_id in table
        } - {0}

    def _write(self, req: FakeRequest, start: int, end: int) -> None:
        """The model writes positions [start, end) of the request into its blocks."""
        for table in self.manager.get_block_ids(req):
            for pos in range(start, end):
                block_id = table[pos // BLOCK_SIZE]
                if block_id != 0:
                    self.shadow.setdefault(block_id, [None] * BLOCK_SIZE)[pos % BLOCK_SIZE] = (
                        req.all_token_ids[pos]
                    )

    def _allocate(self, req: FakeRequest, **kwargs) -> bool:
        others = self._held_by_others(req.request_id)
        free_before = self.manager.get_num_free_blocks()
        held_before = [set(t) - {0} for t in self.manager.get_block_ids(req)]
        new = self.manager.allocate_slots(req, **kwargs)
        if new is None:
            held_after = [set(t) - {0} for t in self.manager.get_block_ids(req)]
            assert all(after <= before for after, before in zip(held_after, held_before))
            assert self.manager.get_num_free_blocks() >= free_before
            return False
        handed_out = {b for group in new.get_block_ids() for b in group}
        assert not handed_out & others, "a live request's block was handed out"
        fresh = {b.block_id for group in new.blocks for b in group if not b.is_null}
        assert not fresh & self._pinned_ids(), "a pinned block was handed out"
        return True

    def _pinned_ids(self) -> set[int]:
        return {block_id for blocks in self.pinned.values() for block_id in blocks} | {
            block_id for blocks in self.retired.values() for block_id, _ in blocks
        }

    def _drop_hashes(self, drop) -> None:
        """Run an explicit evict / reset, remembering free blocks it left unhashed in place."""
        cached_free = {
            b.block_id for b in self.pool.blocks if b.ref_cnt == 0 and b.block_hash is not None
        }
        drop()
        self.unhashed_in_place |= {b for b in cached_free if self.pool.blocks[b].block_hash is None}

    def _preempt(self, req: FakeRequest) -> None:
        self.manager.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        del self.running[req.request_id]
        self.waiting[req.request_id] = req

    # rules

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 3), min_size=1, max_size=12),
        salt=st.sampled_from([None, None, "t1"]),
    )
    def add_request(self, prefix, suffix, salt):
        req = FakeRequest(
            f"r{self.next_id}", (prefix + suffix)[: MAX_MODEL_LEN - 8], HASHER, cache_salt=salt
        )
        self.next_id += 1
        self._record_hashes(req)
        self.waiting[req.request_id] = req

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 12), external=st.booleans())
    def admit(self, data, chunk, external):
        req = self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))]
        hit, num_hit_tokens = self.manager.get_computed_blocks(req)
        assert num_hit_tokens <= req.num_tokens - 1
        for group in hit.blocks:
            for index, block in enumerate(group):
                if not block.is_null:
                    expected = req.all_token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
                    assert self.shadow[block.block_id] == expected, (
                        "a prefix hit holds other tokens"
                    )
        remaining = req.num_tokens - num_hit_tokens
        if external and remaining > 1:
            # A decode worker: the connector loads all but the last token, caching waits for it.
            num_external = remaining - 1
            if not self._allocate(
                req,
                num_new_tokens=0,
                num_new_computed_tokens=num_hit_tokens,
                new_computed_blocks=hit,
                num_external_computed_tokens=num_external,
                delay_cache_blocks=True,
            ):
                return
            self._write(req, num_hit_tokens, num_hit_tokens + num_external)
            self.manager.cache_blocks(req, num_hit_tokens + num_external)
            req.num_computed_tokens = num_hit_tokens + num_external
        else:
            num_new = min(chunk, remaining)
            if not self._allocate(
                req,
                num_new_tokens=num_new,
                num_new_computed_tokens=num_hit_tokens,
                new_computed_blocks=hit,
            ):
                return
            self._write(req, num_hit_tokens, num_hit_tokens + num_new)
            req.num_computed_tokens = num_hit_tokens + num_new
        del self.waiting[req.request_id]
        self.running[req.request_id] = req

    @precondition(lambda self: self.running)
    @rule(
        data=st.data(),
        chunk=st.integers(1, 12),
        lookahead=st.sampled_from([0, 0, 2]),
        token=st.integers(0, 3),
    )
    def step(self, data, chunk, lookahead, token):
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if req.num_computed_tokens == req.num_tokens:  # prefill done: sample a token
            if req.num_tokens >= MAX_MODEL_LEN - 4:
                return
            req.append_token(token)
            self._record_hashes(req)
        start = req.num_computed_tokens
        num_new = min(chunk, req.num_tokens - start)
        if not self._allocate(req, num_new_tokens=num_new, num_lookahead_tokens=lookahead):
            self._preempt(req)
            return
        self._write(req, start, start + num_new)
        req.num_computed_tokens += num_new

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.running)))
        self.manager.free(self.running.pop(request_id))

    @precondition(lambda self: self.hash_tokens)
    @rule(data=st.data())
    def evict(self, data):
        block_hash = data.draw(st.sampled_from(sorted(self.hash_tokens)))
        self._drop_hashes(lambda: self.manager.evict_blocks([block_hash]))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def pin(self, data):
        """A lease offers (or re-offers) a request's computed full blocks."""
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        tables = self.manager.get_computed_block_ids_for_peer(req)
        ids = [block_id for table in tables for block_id in table]
        for table in tables:  # only blocks whose tokens are all computed, null where unread
            for index, block_id in enumerate(table):
                if block_id != 0:
                    expected = req.all_token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
                    assert self.shadow[block_id] == expected
        self.manager.pin_blocks(req.request_id, ids)
        before = self.pinned.get(req.request_id, {})
        self.pinned[req.request_id] = {b: list(self.shadow[b]) for b in ids if b != 0}
        left = [(b, tokens) for b, tokens in before.items() if b not in self.pinned[req.request_id]]
        if left:
            self.retired.setdefault(req.request_id, []).extend(left)

    @precondition(lambda self: self.retired)
    @rule(data=st.data())
    def release_retired(self, data):
        """No read of the owner's lease is in flight any more."""
        owner = data.draw(st.sampled_from(sorted(self.retired)))
        self.manager.release_retired(owner)
        del self.retired[owner]

    @precondition(lambda self: self.pinned)
    @rule(data=st.data())
    def unpin(self, data):
        owner = data.draw(st.sampled_from(sorted(self.pinned)))
        self.manager.unpin_blocks(owner)
        del self.pinned[owner]
        self.retired.pop(owner, None)

    @rule()
    def reset(self):
        anything_held = bool(self._pinned_ids()) or any(
            any(t) for r in self.running.values() for t in self.manager.get_block_ids(r)
        )
        reset: list[bool] = []
        self._drop_hashes(lambda: reset.append(self.manager.reset_prefix_cache()))
        assert reset == [not anything_held]

    # invariants

    @invariant()
    def free_xor_referenced_and_counts_match(self):
        free = self.pool.free_block_queue.get_all_free_blocks()
        assert len(free) == self.pool.get_num_free_blocks()
        assert {b.block_id for b in free} == {
            b.block_id for b in self.pool.blocks if b.ref_cnt == 0 and not b.is_null
        }
        held = Counter(
            block_id
            for r in self.running.values()
            for t in self.manager.get_block_ids(r)
            for block_id in t
        )
        held.pop(0, None)
        for blocks in self.pinned.values():  # a reference per owner that pins the block
            held.update(blocks.keys())
        for retired in self.retired.values():  # and one each time a pin left it out
            held.update(block_id for block_id, _ in retired)
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == held.get(block.block_id, 0), (
                f"block {block.block_id} ref_cnt is off"
            )
        null = self.pool.null_block
        assert null.ref_cnt == 0 and null.block_hash is None and null.prev_free_block is None

    @invariant()
    def unhashed_free_blocks_are_reused_before_any_cached_one(self):
        """vLLM's free-queue policy: a freed block without a hash never waits behind a
        cached free block (except one whose hash an explicit evict / reset dropped)."""
        self.unhashed_in_place = {
            b for b in self.unhashed_in_place if self.pool.blocks[b].ref_cnt == 0
        }
        seen_cached = False
        for block in self.pool.free_block_queue.get_all_free_blocks():
            if block.block_hash is not None:
                seen_cached = True
            elif seen_cached:
                assert block.block_id in self.unhashed_in_place, (
                    f"unhashed block {block.block_id} waits behind a cached one"
                )

    @invariant()
    def hash_index_points_at_blocks_holding_those_tokens(self):
        indexed = 0
        for key, block in self.pool.cached_block_hash_to_block.items():
            indexed += 1
            assert block.block_hash == key
            assert self.shadow[block.block_id] == list(self.hash_tokens[get_block_hash(key)])
        assert indexed == sum(1 for b in self.pool.blocks if b.block_hash is not None)

    @invariant()
    def pinned_blocks_keep_what_they_held_when_pinned(self):
        for blocks in self.pinned.values():
            for block_id, tokens in blocks.items():
                assert self.shadow[block_id] == tokens, f"pinned block {block_id} was rewritten"
        for retired in self.retired.values():
            for block_id, tokens in retired:
                assert self.shadow[block_id] == tokens, f"retired block {block_id} was rewritten"

    @invariant()
    def live_requests_still_hold_their_tokens(self):
        for req in self.running.values():
            for table in self.manager.get_block_ids(req):
                for pos in range(req.num_computed_tokens):
                    block_id = table[pos // BLOCK_SIZE]
                    if block_id != 0:
                        assert self.shadow[block_id][pos % BLOCK_SIZE] == req.all_token_ids[pos]

    def teardown(self):
        for req in list(self.running.values()):
            self.manager.free(req)
        for owner in self.pinned:
            self.manager.unpin_blocks(owner)
        assert self.manager.get_num_free_blocks() == self.pool.num_blocks - 1
        assert self.manager.usage == 0.0


class HybridLedgerMachine(LedgerMachine):
    sliding_window = 8


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFullAttentionLedger = LedgerMachine.TestCase
TestFullAttentionLedger.settings = SETTINGS
TestHybridLedger = HybridLedgerMachine.TestCase
TestHybridLedger.settings = SETTINGS
