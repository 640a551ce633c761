"""Log-probabilities of sampled tokens, as workers report them to the gateway."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # top alternatives per token, as vLLM and OpenAI allow


@dataclass(slots=True)
class TokenLogprobs:
    """One sampled token's log-probability, and the ``k`` most likely tokens at its position.

    Log-probabilities are of the model's own distribution (``log_softmax`` of the raw
    logits, before temperature, top-k or top-p), as vLLM reports them by default: they say
    how likely the model found a token, whatever sampler settings picked it.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first
    rank: int | None = None  # 1 + the tokens the model found likelier (vLLM's rank)
