"""Speculative decoding on the decode side: propose drafts, verify them in one forward.

proposer.py          what the scheduler asks of a drafter
ngram_proposer.py    prompt lookup: the tokens that followed the context's suffix earlier
draft_model_proposer.py  a smaller model's guesses, over its own KV pages
draft_acceptance.py  a request's recent acceptance, and when it pauses drafting
verification.py      which drafts the target's own samples confirm
spec_decode_stats.py drafted / accepted counters, per position (vLLM's metrics)
"""

from pdserve.engine.spec_decode.draft_acceptance import DraftAcceptance
from pdserve.engine.spec_decode.draft_model_proposer import (
    DraftModel,
    DraftModelProposer,
    check_draft_model,
    load_draft_model,
)
from pdserve.engine.spec_decode.ngram_proposer import NgramProposer
from pdserve.engine.spec_decode.proposer import DraftState, Proposer
from pdserve.engine.spec_decode.spec_decode_stats import SpecDecodeStats
from pdserve.engine.spec_decode.verification import accepted_tokens

__all__ = [
    "DraftAcceptance",
    "DraftModel",
    "DraftModelProposer",
    "DraftState",
    "NgramProposer",
    "Proposer",
    "SpecDecodeStats",
    "accepted_tokens",
    "check_draft_model",
    "load_draft_model",
]
