"""The engine both worker kinds run, and the colocated baseline: add, step, abort."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.cache import (
    BlockHasher,
    BlockRemoved,
    KVCacheConfig,
    KVCacheEvent,
    KVCacheManager,
    RequestBlockHasher,
    num_blocks_for_memory,
)
from pdserve.engine.engine_stats import EngineStats
from pdserve.engine.kv_cache_groups import kv_cache_groups
from pdserve.engine.kv_connector_base import KVConnectorBase
from pdserve.engine.logits_processors import RowHistory
from pdserve.engine.lora_registry import LoRARegistry
from pdserve.engine.model_input import ScheduledChunk
from pdserve.engine.model_runner import ModelRunner, allocate_kv_pages, configure_torch_threads
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.request_output import RequestOutput
from pdserve.engine.sampler import sample, token_logprobs
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.spec_decode import (
    DraftModel,
    DraftModelProposer,
    NgramProposer,
    Proposer,
    SpecDecodeStats,
    accepted_tokens,
    load_draft_model,
)
from pdserve.engine.tensor_parallel_peers import TensorParallelPeers
from pdserve.engine.token_bitmask import fill_token_bitmask, num_masked_tokens
from pdserve.engine.token_counts import TokenCounts
from pdserve.grammar import GrammarCompiler
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.kv_transfer_params import KVTransferParams
from pdserve.messages.lora_adapters import LoRAAdapterRef
from pdserve.messages.sampling_params import SamplingParams
from pdserve.model.freed_memory import release_freed_memory
from pdserve.model.loader import load_model
from pdserve.model.lora.peft_adapter import LoRAAdapter
from pdserve.model.model_config import resolve_device, resolve_dtype
from pdserve.model.sim_model import capacity_config
from pdserve.stats.start_phases import start_phase
from pdserve.tokenizer.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    import torch

# While a pull is in flight and nothing else can run, wait this long for it per step.
_IDLE_WAIT_S = 0.005

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer
    # What earlier delta outputs reported (step(delta=True)).
    reported_tokens: int = 0
    reported_chars: int = 0
    reported_prompt_logprobs: bool = False


class LLMEngine:
    """One model, one ledger, one scheduler; optionally a KV connector.

    ``step()`` runs one batch: schedule, start KV pulls, run the model on the scheduled
    chunks, sample, apply stops, and report every request whose output changed. A server
    calls it in a loop; ``generate()`` is that loop for a list of prompts.
    """

    def __init__(
        self,
        config: EngineConfig,
        connector: KVConnectorBase | None = None,
        on_rank_lost: Callable[[], None] | None = None,
    ) -> None:
        """``on_rank_lost``: called, from a watchdog thread, when a tensor-parallel rank
        dies (the engine cannot step again; a worker exits, to be restarted whole)."""
        configure_torch_threads(config.torch_threads)
        config = dataclasses.replace(config, device=resolve_device(config.device))
        if config.tensor_parallel_size > 1 and config.device != "cpu":
            raise ValueError(
                f"tensor_parallel_size {config.tensor_parallel_size} on {config.device}: "
                "tensor-parallel ranks share one host mapping of the KV pages, so they run on "
                "CPU only for now (per-rank GPU pages are not built)"
            )
        self.config = config
        with start_phase("model_build"):  # the weights' read is a phase of its own
            self.model, self.model_config, self.tokenizer = load_model(
                config.model,
                config.dtype,
                config.device,
                config.quantization,
                config.sim_time_scale,
            )
        groups = kv_cache_groups(self.model_config, config)
        draft = None
        if config.speculative_method == "draft_model":
            with start_phase("draft_model"):
                draft = load_draft_model(config, self.model_config)
        # A draft model's pool holds as many blocks as the model's, out of the same budget.
        beside = [] if draft is None else [kv_cache_groups(draft.model_config, config)]
        num_blocks = config.num_kv_blocks or num_blocks_for_memory(
            # A simulated model's placeholder pages hold the real model's count of blocks.
            config.kv_cache_memory_bytes,
            kv_cache_groups(capacity_config(self.model, self.model_config), config),
            beside,
        )
        kv_cache_config = KVCacheConfig(num_blocks, groups)
        with start_phase("kv_pool"):  # the pages, the runner's tables (tensor-parallel peers)
            self.runner = self._make_runner(num_blocks, on_rank_lost)
        # The engine owns the connector from here on, as ``shutdown`` says.
        self.connector = connector
        self._shut_down = False
        try:
            # After the runner: under tensor parallelism its model is this rank's slice, and
            # an adapter is read for the slice (``model/tensor_parallel.py``).
            self.lora = LoRARegistry(
                self.model,
                config.max_loras,
                config.max_lora_rank,
                config.load_lora_on_demand,
                self._adapters_in_use,
            )
            for name, path in config.lora_modules.items():
                self.lora.load(name, path)
            self.runner.lora_adapters = self.lora.resident
            self._build_around_runner(config, kv_cache_config, draft)
        except BaseException:  # the ranks started above, and whatever the connector started
            try:  # as it registered the pages, would outlive a failed engine
                self.shutdown()
            except Exception:  # the caller gets the error that failed the engine
                logger.exception("stopping the parts of an engine that failed to start failed")
            raise

    def _build_around_runner(
        self,
        config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        draft: DraftModel | None,
    ) -> None:
        """The ledger, the connector's view of the KV pages, the scheduler and the
        counters: everything after the runner (and its ranks) exists."""
        num_blocks = kv_cache_config.num_blocks
        groups = kv_cache_config.kv_cache_groups
        self.block_hasher = BlockHasher(config.hash_algorithm, config.hash_seed)
        self.max_model_len = config.max_model_len_for(
            self.model_config.max_position_embeddings, num_blocks, groups
        )
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config,
            self.max_model_len,
            enable_caching=config.enable_prefix_caching,
            enable_kv_cache_events=True,
        )
        connector = self.connector
        if connector is not None:
            with start_phase("connector"):  # registers the pages (a NIXL agent's memory)
                connector.register_kv_caches(self.runner.kv_cache, self.model_config.fingerprint)
            connector.attach_kv_cache_manager(self.kv_cache_manager)
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            block_size=config.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            eos_token_ids=frozenset(self.model_config.eos_token_ids),
            connector=connector,
            failure_policy=connector.failure_policy if connector else "recompute",
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            proposer=_proposer(config, num_blocks, self.runner, draft),
        )
        self._stats = EngineStats(num_blocks=num_blocks)
        if config.speculative_method != "off":  # a series per draft position from the start
            self._stats.spec_decode = SpecDecodeStats.for_positions(config.num_speculative_tokens)
        self._finished_on_arrival: list[Request] = []
        self._kv_events: list[KVCacheEvent] = []
        self._tracked: dict[str, _Tracked] = {}
        self._seed_rng = random.Random(config.seed)
        # Structured outputs' grammars over this model's vocabulary (EngineHost compiles off
        # the engine thread through it; add_request then finds them cached).
        self.grammar_compiler = GrammarCompiler(
            self.tokenizer.backend, self.model_config.vocab_size, self.tokenizer.eos_token_ids
        )
        # What the load and the runner's set-up freed goes back to the OS (``freed_memory``).
        release_freed_memory()

    def _make_runner(self, num_blocks: int, on_rank_lost: Callable[[], None] | None) -> ModelRunner:
        """Rank 0's runner; under tensor parallelism its peers first, over KV pages in
        shared memory that every rank maps."""
        config = self.config
        if config.tensor_parallel_size == 1:
            return ModelRunner.for_engine(config, self.model, self.model_config, num_blocks)
        kv_pages = allocate_kv_pages(
            self.model_config,
            num_blocks,
            config.block_size,
            resolve_dtype(config.resolved_kv_cache_dtype),
            config.device,
        ).share_memory_()
        peers = TensorParallelPeers(config, num_blocks, kv_pages, on_rank_lost)
        try:
            runner = ModelRunner.for_engine(
                config,
                self.model,
                self.model_config,
                num_blocks,
                kv_pages,
                peers.tensor_parallel,
                peers,
            )
            peers.wait_ready()
        except BaseException:
            peers.close()
            raise
        return runner

    @classmethod
    def from_pretrained(
        cls, model: str = "tiny", *, connector: KVConnectorBase | None = None, **config: Any
    ) -> LLMEngine:
        """``config``: further ``EngineConfig`` fields, by name (EngineConfig checks them)."""
        return cls(EngineConfig(model=model, **config), connector=connector)

    # ---- requests -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        remote_decode: bool = False,
        kv_transfer_params: KVTransferParams | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
    ) -> None:
        """Queues a request. ``remote_decode`` (prefill worker): lease the prompt's blocks for
        a decode worker when it finishes. ``kv_transfer_params`` (decode worker): the prompt's
        KV and first token come from that prefill worker; an offer (``final`` False) makes
        the request KV-only: it pulls the offered blocks into the prefix cache and ends.
        ``lora_name``: a registered adapter run for this request alone; ``lora_path``: where
        to read it should this engine lack it (``engine/lora_registry.py``)."""
        params = params or SamplingParams()
        adapter = None
        if lora_name is not None:
            adapter = self.lora.for_request(lora_name, lora_path)
        if kv_transfer_params is not None:
            check_handoff_adapter(kv_transfer_params.lora_digest, lora_name, adapter)
        if request_id in self._tracked or self.scheduler.holds(request_id):
            # Held: a finished request's blocks under its lease, which a new request of the
            # same id would take over (and leak) through the connector's lease of that id.
            raise ValueError(
                f"request id {request_id!r} is already in use, or its blocks are still "
                f"held for a decode worker"
            )
        prompt_token_ids = self._validate_prompt(prompt)
        if kv_transfer_params is not None and self.connector is None:
            raise ValueError("kv_transfer_params given, but this engine has no KV connector")
        kv_only = kv_transfer_params is not None and not kv_transfer_params.final
        if (
            kv_transfer_params is not None
            and kv_only
            and (kv_transfer_params.num_tokens != len(prompt_token_ids))
        ):
            raise ValueError(
                f"an offer of {kv_transfer_params.num_tokens} tokens comes with a prompt of "
                f"{len(prompt_token_ids)}: send the offered tokens only"
            )
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        if kv_transfer_params is not None:
            seed = kv_transfer_params.sampling_seed
        # A GrammarError is a ValueError: the request is refused. EngineHost compiled the
        # grammar off this thread already, so this is a cache hit there.
        grammar = self.grammar_compiler.matcher(params.structured) if params.structured else None
        request = Request(
            request_id,
            prompt_token_ids,
            params,
            seed,
            RequestBlockHasher(self.block_hasher, self.config.block_size),
            cache_salt=cache_salt,
            lora_name=lora_name,
            lora_id=adapter.digest if adapter is not None else None,
            remote_decode=remote_decode,
            kv_transfer_params=kv_transfer_params,
            grammar=grammar,
            kv_only=kv_only,
        )
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            params.stop,
            params.min_tokens,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
            params.spaces_between_special_tokens,
        )
        tracked = _Tracked(request, detokenizer)
        self._tracked[request_id] = tracked
        if kv_only:  # no request of a user's: counted in the transfer stats only
            self.scheduler.add_request(request)
            return
        self._stats.num_requests += 1
        self._stats.num_structured_requests += grammar is not None
        if kv_transfer_params is not None:
            # The prefill worker sampled the first token (under the grammar, if any: the
            # matcher advances past it here); it may already end the request, and then the
            # lease is released unread and the next step reports it.
            request.append_output_token(kv_transfer_params.first_token_id)
            if params.logprobs is not None:  # its logprob is the prefill worker's to report
                request.output_logprobs.append(None)
            status = self.scheduler.check_stop(request)
            stop = tracked.detokenizer.update(request.text_token_ids)
            if stop is not None:
                request.stop_reason, status = stop, RequestStatus.FINISHED_STOPPED
            if status is not None:
                request.status = status
                if self.connector is None:  # checked on entry: kv_transfer_params need one
                    raise RuntimeError("kv_transfer_params given, but this engine has no connector")
                self.connector.request_aborted(request)
                self._finished_on_arrival.append(request)
                return
        self.scheduler.add_request(request)

    def _validate_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            vocab_size = self.model_config.vocab_size
            bad = next(
                (t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None
            )
            if bad is not None:
                raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab_size})")
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than max_model_len "
                f"({self.max_model_len})"
            )
        return token_ids

    def abort(self, request_id: str) -> bool:
        """Aborts a request; its blocks (and lease) are freed. False if it is unknown."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return self.scheduler.abort_request(request_id) is not None  # a held lease
        self.scheduler.abort_request(request_id)
        return True

    def withdraw(self, request_id: str) -> bool:
        """Drops a request that has not started (``Scheduler.is_unstarted``) so that it can
        run on another worker; False, and the request goes on here, once it has started."""
        if not self.scheduler.is_unstarted(request_id) or not self.abort(request_id):
            return False
        self._stats.num_requests_withdrawn += 1
        return True

    def abort_all(self) -> list[str]:
        """Aborts every unfinished request (after a failed step) and frees every block that
        no transfer still writes; returns the aborted ids. Leases of finished prefills stay:
        their decode workers may be reading them."""
        aborted = list(self._tracked)
        for request_id in aborted:
            self.abort(request_id)
        self.scheduler.free_aborted_loads()
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked) or self.scheduler.has_unfinished_requests()

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued to start, including those waiting for remote KV."""
        return len(self.scheduler.waiting) + len(self.scheduler.waiting_for_remote_kvs)

    @property
    def num_prompt_tokens_to_compute(self) -> int:
        """Prompt tokens queued or running that no step has computed yet: the backlog an
        autoscaler weighs against the prefill rate (``deploy/scaling_policy.py``)."""
        return sum(
            max(0, request.num_prompt_tokens - request.num_computed_tokens)
            for request in (*self.scheduler.waiting, *self.scheduler.running)
        )

    @property
    def rank_pids(self) -> list[int]:
        """The process ids of the tensor-parallel peers (ranks 1..k-1; none at TP=1)."""
        return self.runner.peers.pids if self.runner.peers is not None else []

    @property
    def num_leases_held(self) -> int:
        """Finished requests whose blocks stay pinned under a lease for a decode worker."""
        return self.scheduler.num_held_for_leases

    # ---- one step -------------------------------------------------------------------
    def step(self, delta: bool = False) -> list[RequestOutput]:
        """One step: schedule, load, forward, sample, apply; the requests that changed.

        ``delta``: each output holds only what is new since the request's previous one
        (``RequestOutput.delta``; vLLM's ``RequestOutputKind.DELTA``), so a long stream costs
        O(n) to report, not O(n) per step. A caller keeps to one kind per request.

        A step that raises leaves no hash behind for a block it cached: the forward that
        was to write those blocks may not have run (``KVCacheManager.uncache_step_blocks``).
        The caller then aborts every request (``abort_all``, as ``EngineHost`` does)."""
        try:
            changed = self._step(delta)
        except BaseException:
            self.kv_cache_manager.uncache_step_blocks()
            raise
        self.kv_cache_manager.end_step()
        return changed

    def _step(self, delta: bool) -> list[RequestOutput]:
        scheduler = self.scheduler
        output = scheduler.schedule()
        if self.connector is not None and output.connector_metadata is not None:
            self.connector.start_load_kv(output.connector_metadata)
        changed, self._finished_on_arrival = self._finished_on_arrival, []
        changed += scheduler.take_ended_at_admission()
        offers: list[tuple[Request, KVTransferParams]] = []
        if output.chunks:
            logits = self._sampled_rows(self.runner.execute(output.chunks), output)
            sampled = [(c, r) for c, r in zip(output.chunks, output.requests) if c.sample]
            # One row per sampled position: a chunk's last token, then each of its drafts.
            rows = [
                (r, r.num_output_tokens + j) for c, r in sampled for j in range(c.num_sample_rows)
            ]
            token_ids = sample(
                logits,
                [r.sampling_params for r, _ in rows],
                [r.sampling_seed for r, _ in rows],
                [position for _, position in rows],
                self._token_bitmask(sampled, logits.shape[1]),
                _row_histories(sampled),
                self.scheduler.eos_token_ids,
            )
            new_token_ids = self._verify(sampled, token_ids)
            num_before = [r.num_output_tokens for _, r in sampled]
            changed += scheduler.update_from_output(output, new_token_ids)
            _record_logprobs(logits, sampled, num_before)
            self._stats.record_step(output.num_scheduled_tokens, sum(map(len, new_token_ids)))
            offers = scheduler.offer_computed_blocks(output)
        if self.connector is not None:
            self.connector.wait_for_save()
            if not output.chunks and self.connector.has_pending_loads():
                self.connector.wait_for_progress(_IDLE_WAIT_S)
            changed += scheduler.update_from_kv_xfer_finished(self.connector.get_finished())
        self._stats.num_evictions += self._collect_kv_events()
        outputs = [self._make_output(request, delta) for request in changed]
        return outputs + [self._make_output(r, delta, offer=offer) for r, offer in offers]

    def _token_bitmask(
        self, sampled: list[tuple[ScheduledChunk, Request]], vocab_size: int
    ) -> torch.Tensor | None:
        """The tokens each sampled row's grammar allows, a draft's row in the state after
        the drafts before it (None: no row has a grammar)."""
        bitmask = fill_token_bitmask(
            [(r.grammar, c.draft_token_ids) for c, r in sampled], vocab_size
        )
        if bitmask is not None:
            rows = [
                row
                for (_, request), span in zip(sampled, _sample_spans(sampled))
                if request.grammar is not None
                for row in span
            ]
            self._stats.num_constrained_rows += len(rows)
            self._stats.num_masked_tokens += num_masked_tokens(bitmask, rows, vocab_size)
        return bitmask

    def _verify(
        self, sampled: list[tuple[ScheduledChunk, Request]], token_ids: list[int]
    ) -> list[list[int]]:
        """Each sampling chunk's new tokens: its one sample, or its drafts' verified run
        (``spec_decode/verification.py``), counted in the stats and the request's
        acceptance."""
        runs = []
        for (chunk, request), span in zip(sampled, _sample_spans(sampled)):
            rows = token_ids[span.start : span.stop]
            if not chunk.num_draft_tokens:
                runs.append(rows)
                continue
            run = accepted_tokens(chunk.draft_token_ids, rows)
            reasoning_ends = request.grammar_starts_within(run)
            if reasoning_ends is not None:  # what follows was drawn without the grammar
                run = run[: reasoning_ends + 1]
            num_accepted = len(run) - 1
            self._stats.spec_decode.record(chunk.num_draft_tokens, num_accepted)
            if request.drafts is not None:
                request.drafts.acceptance.record(chunk.num_draft_tokens, num_accepted)
            runs.append(run)
        return runs

    @staticmethod
    def _sampled_rows(logits: torch.Tensor, output: SchedulerOutput) -> torch.Tensor:
        """The sampling rows of a step's logits; a prompt-logprobs chunk's other rows are
        turned into its prompt's logprobs on the way (row ``k`` of a chunk starting at
        position ``p`` predicts the token at ``p + k + 1``)."""
        if not any(chunk.all_logits for chunk in output.chunks):
            return logits
        rows: list[int] = []
        offset = 0
        for chunk, request in zip(output.chunks, output.requests):
            count = chunk.num_logit_rows
            if chunk.all_logits:
                _record_prompt_logprobs(logits[offset : offset + count], chunk, request)
            rows += range(offset + count - chunk.num_sample_rows, offset + count)
            offset += count
        return logits[rows]

    def _collect_kv_events(self) -> int:
        """Moves the ledger's events to the publish buffer (if publishing); returns how many
        cached blocks were evicted this step."""
        events = self.kv_cache_manager.take_events()
        if self.connector is not None:
            events += self.connector.take_events()
        if self.config.publish_kv_events:
            self._kv_events.extend(events)
        return sum(
            len(e.block_hashes) for e in events if isinstance(e, BlockRemoved) and e.medium is None
        )

    def take_kv_events(self) -> list[KVCacheEvent]:
        """KV events since the last call, for the router's prefix index."""
        events, self._kv_events = self._kv_events, []
        return events

    def stats(self) -> EngineStats:
        """A copy of this engine's counters, safe to send to another process."""
        self._stats.record_cache(self.kv_cache_manager, self.scheduler.counters)
        self._stats.grammar = dataclasses.replace(self.grammar_compiler.stats)
        return self._stats.snapshot(self.connector)

    def _make_output(
        self, request: Request, delta: bool = False, offer: KVTransferParams | None = None
    ) -> RequestOutput:
        """The request's output; ``offer``: a chunk-wise hand-off's offer it carries (no
        tokens: the request is still prefilling)."""
        tracked = self._tracked.get(request.request_id)
        if tracked is not None:
            detokenizer = tracked.detokenizer
            stop = detokenizer.update(request.text_token_ids)
            cut = detokenizer.num_tokens_at_stop
            if stop is not None and cut is not None:
                # Inside a speculative run, the tokens after the stop string's are not
                # output: the request ends where a token-by-token decode would have.
                if not request.is_finished:
                    request.stop_reason = stop
                    self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
                elif (
                    cut < request.num_output_tokens
                    or request.status == RequestStatus.FINISHED_LENGTH_CAPPED
                ):
                    # Its last allowed token completed the stop string: a stop, not a length
                    # (a prefill worker's first token that did is not handed off).
                    self.scheduler.stopped_after_finish(request, stop)
                request.truncate_output(cut)
        if request.is_finished:
            self._tracked.pop(request.request_id, None)
            request.finish_time = request.finish_time or time.time()
            if not request.kv_only:
                self._stats.record_finished(request)
        num_output_tokens = len(request.output_token_ids)
        first_token = first_char = text_end = 0
        prompt_logprobs = request.prompt_logprobs if not request.needs_prompt_logprobs else []
        if tracked is not None:  # a running request's text only grows: see stable_length
            detokenizer = tracked.detokenizer
            text_end = len(detokenizer.text) if request.is_finished else detokenizer.stable_length
            if delta:
                first_token, first_char = tracked.reported_tokens, tracked.reported_chars
                if tracked.reported_prompt_logprobs:
                    prompt_logprobs = []  # once, with the first output that has them all
                tracked.reported_prompt_logprobs |= bool(prompt_logprobs)
                tracked.reported_tokens, tracked.reported_chars = num_output_tokens, text_end
        text = tracked.detokenizer.text[first_char:text_end] if tracked is not None else ""
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids[first_token:num_output_tokens],
            output_logprobs=request.output_logprobs[first_token:num_output_tokens],
            prompt_logprobs=list(prompt_logprobs),
            text=text,
            delta=delta,
            num_output_tokens=num_output_tokens,
            finished=request.is_finished,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            arrival_time=request.arrival_time,
            first_token_time=request.first_token_time,
            finish_time=request.finish_time,
            num_cached_tokens=request.num_cached_tokens,
            error=request.error,
            kv_transfer_params=offer or request.kv_transfer_params_out,
            kv_provenance=request.kv_provenance() if request.is_finished else None,
            stamps=request.stamps,
        )

    # ---- the colocated loop ---------------------------------------------------------
    # ---- LoRA adapters ----------------------------------------------------------------
    def load_lora_adapter(self, name: str, path: str) -> LoRAAdapterRef:
        """Loads the PEFT adapter in ``path`` as ``name`` while the engine serves; read and
        checked before anything changes, so a bad one changes nothing. Blocks cached under
        an adapter stay keyed by its weights: loading the same files again finds them."""
        return self.lora.load(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Unregisters adapter ``name``: new requests cannot name it; those running it end
        on its weights."""
        if not self.lora.unload(name):
            raise ValueError(
                f"unknown LoRA adapter {name!r}; this engine serves {self.lora.names()}"
            )

    def _adapters_in_use(self) -> set[str]:
        """The digests of the adapters live requests run (``LoRARegistry`` keeps them)."""
        return {
            tracked.request.lora_id
            for tracked in self._tracked.values()
            if tracked.request.lora_id is not None
        }

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_names: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs ``prompts`` to completion; outputs in prompt order; ``lora_names``: each
        prompt's adapter (None: the base model).

        The offline API: it steps the engine until its own requests finish, so it refuses
        to run beside requests added with ``add_request`` (their outputs would be consumed
        here, never reaching whoever steps for them). A step that raises aborts its
        requests, so none is left holding blocks."""
        if self._tracked:
            raise RuntimeError(
                f"generate() needs an engine with no request in flight ({len(self._tracked)} "
                "are): step() the engine for those, or call generate() once they finished"
            )
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
        base = f"gen-{time.monotonic_ns()}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        adapters = list(lora_names) if lora_names is not None else [None] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} lora_names")
        for request_id, prompt, request_params, lora_name in zip(
            ids, prompts, params_list, adapters
        ):
            self.add_request(request_id, prompt, request_params, lora_name=lora_name)
        finished: dict[str, RequestOutput] = {}
        try:
            while len(finished) < len(ids):
                for out in self.step():
                    if out.finished:
                        finished[out.request_id] = out
        except BaseException:
            for request_id in ids:
                self.abort(request_id)
            raise
        return [finished[request_id] for request_id in ids]

    def shutdown(self) -> None:
        """Stops the connector's servers and threads and the tensor-parallel ranks (once:
        later calls do nothing)."""
        if self._shut_down:
            return
        self._shut_down = True
        try:
            if self.connector is not None:
                self.connector.shutdown()
        finally:  # a connector that fails to stop must not leave the ranks running
            if self.runner.peers is not None:
                self.runner.peers.close()


def _record_logprobs(
    logits: torch.Tensor, sampled: list[tuple[ScheduledChunk, Request]], num_before: list[int]
) -> None:
    """Appends the logprobs of the tokens each request gained this step (its output past
    ``num_before``; row ``j`` of a chunk's sample rows gave its ``j``-th new token), for the
    requests that ask for them."""
    rows: list[int] = []
    tokens: list[int] = []
    num_tops: list[int] = []
    owners: list[Request] = []
    for (_, request), before, span in zip(sampled, num_before, _sample_spans(sampled)):
        num_top = request.sampling_params.logprobs
        new_tokens = request.output_token_ids[before:]
        if num_top is not None:
            rows += span[: len(new_tokens)]
            tokens += new_tokens
            num_tops += [num_top] * len(new_tokens)
            owners += [request] * len(new_tokens)
    if not rows:
        return
    for owner, result in zip(owners, token_logprobs(logits[rows], tokens, num_tops)):
        owner.output_logprobs.append(result)


def _record_prompt_logprobs(logits: torch.Tensor, chunk: ScheduledChunk, request: Request) -> None:
    """Appends the logprobs of the prompt tokens this chunk's rows predict."""
    prompt = request.prompt_token_ids
    first_target = chunk.start_position + 1
    targets = prompt[first_target : first_target + len(chunk.token_ids)]
    if not targets or first_target != len(request.prompt_logprobs):
        return  # nothing left in the prompt, or already recorded (a recompute)
    k = request.sampling_params.prompt_logprobs
    if k is None:  # not asked for; prompt_logprobs is then empty and the check above returned
        return
    request.prompt_logprobs.extend(
        token_logprobs(logits[: len(targets)], targets, [k] * len(targets))
    )


def _row_histories(sampled: list[tuple[ScheduledChunk, Request]]) -> list[RowHistory] | None:
    """Each sampled row's history for the fields that read it (``logits_processors.py``):
    a penalized request's counts brought up to date, its output, and for a draft's row the
    drafts before it. None when no row's fields adjust its logits."""
    if not any(request.sampling_params.adjusts_logits for _, request in sampled):
        return None
    histories = []
    for chunk, request in sampled:
        counts = None
        if request.sampling_params.penalized:
            if request.token_counts is None:
                request.token_counts = TokenCounts(request.prompt_token_ids)
            request.token_counts.sync(request.output_token_ids)
            counts = request.token_counts
        drafts = chunk.draft_token_ids
        histories += [
            RowHistory(counts, request.output_token_ids, drafts[:j])
            for j in range(chunk.num_sample_rows)
        ]
    return histories


def _sample_spans(sampled: list[tuple[ScheduledChunk, Request]]) -> list[range]:
    """Each sampling chunk's rows of the step's sampled logits (its last token's, then each
    draft's), in chunk order."""
    spans, first = [], 0
    for chunk, _ in sampled:
        spans.append(range(first, first + chunk.num_sample_rows))
        first += chunk.num_sample_rows
    return spans


def _proposer(
    config: EngineConfig, num_blocks: int, runner: ModelRunner, draft: DraftModel | None
) -> Proposer[Any] | None:
    """The drafter ``config.speculative_method`` names (None: speculation is off); a draft
    model gets a pool of ``num_blocks`` pages, as many tokens as the engine's."""
    if config.speculative_method == "off":
        return None
    if draft is not None:
        return DraftModelProposer(draft.model, draft.model_config, config, num_blocks, runner)
    return NgramProposer(
        config.num_speculative_tokens,
        config.prompt_lookup_min,
        config.prompt_lookup_max,
        config.speculative_min_acceptance,
    )


def check_handoff_adapter(
    prefill_digest: str | None, lora_name: str | None, adapter: LoRAAdapter | None
) -> None:
    """Refuses a hand-off whose KV was computed under other weights than this request runs
    here: another adapter (or none), or the same name over other weights."""
    here = adapter.digest if adapter is not None else None
    if prefill_digest == here:
        return
    ran = f"LoRA weights {prefill_digest[:12]}" if prefill_digest else "the base model"
    runs = f"LoRA adapter {lora_name!r} (weights {here[:12]})" if here else "the base model"
    raise ValueError(
        f"the prefill computed this request's KV with {ran}, and it would decode here with "
        f"{runs}: both sides must load the same adapter files"
    )
