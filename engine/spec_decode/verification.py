"""Which drafts a verification forward confirms.

The target model runs once over ``[last token, d_0 .. d_{k-1}]``: row ``j`` of its logits
predicts output position ``p + j``, given the drafts before it. Each row is *sampled*
exactly as a plain decode would sample that position (``sampler.sample``: the draw is a
function of the request's seed, the position and the logits), and a draft is accepted
while it equals the sample at its position::

    rows     t_0   t_1   t_2   t_3   t_4          sampled, one per row
    drafts   d_0   d_1   d_2   d_3                d_0 = t_0, d_1 = t_1, d_2 != t_2
    emitted  t_0   t_1   t_2                      accepted 2, and t_2 (the target's own)

So the emitted tokens are the tokens speculation-off would emit for the same seed,
greedy or sampled: the target distribution is kept exactly (a draft is accepted with
probability p(d), as rejection sampling accepts a one-hot proposal, and a rejection
emits the target's sample, which differs from d), and a seeded request is
reproducible whatever was drafted. The row after the last accepted draft is the
"bonus" token, always emitted.
"""

from __future__ import annotations


def accepted_tokens(draft_token_ids: list[int], sampled_token_ids: list[int]) -> list[int]:
    """The tokens a verified step emits: the sampled tokens up to and including the first
    whose draft differs (all of them, bonus included, when every draft matched).

    ``sampled_token_ids`` has one more entry than ``draft_token_ids``."""
    for position, draft in enumerate(draft_token_ids):
        if sampled_token_ids[position] != draft:
            return sampled_token_ids[: position + 1]
    return sampled_token_ids
