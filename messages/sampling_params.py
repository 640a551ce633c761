"""Per-request sampling settings, validated where the user hands them in."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.grammar import GrammarSpec
from pdserve.messages.logprobs import MAX_LOGPROBS

# The lowest temperature above 0 that sampling uses (vLLM's _MAX_TEMP): below it, a
# temperature is this one.
MIN_TEMPERATURE = 1e-2


@dataclass(slots=True)
class SamplingParams:
    """How to pick each output token, and when to stop.

    Sampling is reproducible per request: the token at output position ``i`` is a
    function of ``(seed, i, logits)`` only, never of batch composition or of which
    worker runs the step. That is what lets a disaggregated request (first token on a
    prefill worker, the rest on a decode worker) equal the colocated engine's output.
    A request without a ``seed`` gets one drawn at arrival, and it travels with the request.

    A temperature above 0 but below ``MIN_TEMPERATURE`` is raised to it, as vLLM does:
    logits divided by 1e-38 leave float32's range, the softmax turns to NaN, and every
    token sampled was id 0.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # report each token's logprob and this many alternatives
    prompt_logprobs: int | None = None  # the same for each prompt token (skips prefix caching)
    # What the output must match (structured outputs); every sampled token is masked by it,
    # on the prefill worker and the decode worker alike.
    structured: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
