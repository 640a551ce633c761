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
    # vLLM's penalties and logits fields, with its semantics (engine/logits_processors.py):
    # presence and frequency over the output's tokens, repetition over the prompt's and
    # the output's.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id → added to its logit
    min_p: float = 0.0  # drop tokens below min_p times the likeliest one's probability
    min_tokens: int = 0  # EOS, stop ids and stop strings cannot end the output before
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    # Token id sequences never output whole (the gateway tokenizes vLLM's ``bad_words``).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # a stop string stays at the text's end
    skip_special_tokens: bool = True  # special tokens add no text (vLLM's default)
    # False: no space a decoder would put between two kept added tokens (vLLM's)
    spaces_between_special_tokens: bool = True
    # A reasoning model's output opens with its reasoning, which ends with these token ids
    # (the reasoning parser's end tag, set by the gateway): ``structured`` constrains only
    # what follows them. Empty: the grammar constrains the output from its first token.
    reasoning_end_token_ids: list[int] = field(default_factory=list)

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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        # Not capped by max_tokens here: a prefill worker runs a request's first token alone
        # (max_tokens 1) under its min_tokens. The API refuses min_tokens > max_tokens.
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for token_id, bias in self.logit_bias.items():
            if token_id < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(
                    f"logit_bias maps token ids >= 0 to values in [-100, 100], got "
                    f"{token_id}: {bias}"
                )
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or min(self.allowed_token_ids) < 0
        ):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids >= 0")
        if any(not word or min(word) < 0 for word in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must be non-empty lists of token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """A penalty applies: the request's token counts are read every step."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def adjusts_logits(self) -> bool:
        """A field changes the logits before sampling (``logits_processors.py``); min_p,
        applied among temperature, top-k and top-p, is not one of them."""
        return (
            self.penalized
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or self.allowed_token_ids is not None
            or bool(self.bad_words_token_ids)
        )
