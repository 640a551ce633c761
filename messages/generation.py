"""A request's way to a worker and its stream back: gateway ↔ worker."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.cache import HashAlgorithm
from pdserve.messages.first_chunk_timing import FirstChunkTiming
from pdserve.messages.kv_provenance import KVProvenance
from pdserve.messages.kv_transfer_params import KVTransferParams
from pdserve.messages.logprobs import TokenLogprobs
from pdserve.messages.lora_adapters import LoRAAdapterRef
from pdserve.messages.sampling_params import SamplingParams


@dataclass(slots=True)
class WorkerRequest:
    """One request handed to a worker's engine.

    ``remote_decode`` asks a prefill worker's connector to lease the request's blocks when
    it finishes by length and to return ``KVTransferParams`` with the last chunk; a decode
    worker gets those params back in ``kv_transfer_params`` (``None`` means recompute).
    ``params.seed`` is always set by the gateway, so both sides sample the same tokens.
    ``cache_salt`` (the client's, or None) goes into the first block's hash on both sides:
    prefix-cache hits, the router's index and the decode side's dedup never cross salts.
    ``call_serial`` tells the gateway's calls of one request apart (it numbers them; 0 is
    unnumbered): the abort of a call it gave up on refuses that call should it arrive later,
    and no other (``EngineHost.abort``).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    remote_decode: bool = False
    kv_transfer_params: KVTransferParams | None = None
    cache_salt: str | None = None
    call_serial: int = 0
    lora: LoRAAdapterRef | None = None
    """The LoRA adapter the request runs, or None: the base model. A worker that lacks it
    reads it from its path (``EngineConfig.load_lora_on_demand``)."""


# Why a request that finished with "stop" stopped (vLLM's ``stop_reason``): the stop token id
# or stop string it met, or ``"grammar: ..."`` when no token could continue its structured
# output; None for an EOS token or a grammar that completed.
StopReason = int | str | None


@dataclass(slots=True)
class GenerationChunk:
    """What one request gained since the previous chunk of its stream.

    Deltas, not the engine's cumulative lists, so a long stream costs O(n) to ship.
    ``num_output_tokens`` is the cumulative count after this chunk. ``refused``: the engine
    turned the request down as invalid (the client's fault, a 400), as opposed to an
    ``error`` while running it (the server's, a 500). ``kv_provenance`` rides on the last
    chunk: where this worker got the prompt's KV (None if it never needed it); ``timing`` on
    the first: where the worker's time to it went. ``withdrawn``: the only chunk of a call
    the gateway took back before it started (``EngineHost.withdraw``), to run elsewhere.
    """

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    num_output_tokens: int
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    error: str | None = None
    refused: bool = False
    stop_reason: StopReason = None  # on the last chunk
    kv_provenance: KVProvenance | None = None
    # Aligned with new_token_ids when the request asked for logprobs, else empty.
    new_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # Once, on the chunk after the prompt was computed, when asked (the first is None).
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    timing: FirstChunkTiming | None = None
    withdrawn: bool = False

    @classmethod
    def withdrawn_from(cls, request_id: str) -> GenerationChunk:
        """The last chunk of a call taken back before it started: no tokens, no error."""
        return cls(request_id, [], "", 0, True, None, withdrawn=True)

    @classmethod
    def failed(cls, request_id: str, error: str, refused: bool = False) -> GenerationChunk:
        """The last chunk of a request that ends in an error, with no tokens: ``refused``
        when the engine turned it down as invalid (a 400), else it failed running (a 500)."""
        return cls(request_id, [], "", 0, True, "error", error=error, refused=refused)


@dataclass(slots=True)
class ModelInfo:
    """What the gateway needs to know about the served model to validate and hash prompts."""

    model: str
    max_model_len: int
    block_size: int
    hash_algorithm: HashAlgorithm
    hash_seed: int | str
    eos_token_ids: list[int]  # every id that ends a reply
