"""What the scheduler hands the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ScheduledChunk:
    """One request's slice of a step.

    ``token_ids`` are computed at positions ``start_position .. start_position + len - 1``;
    their K/V are written into the request's blocks (``block_ids``, the whole block table
    in position order), and attention reads everything from position 0 to the chunk's end.
    A decode step is a chunk of one token; a prefill may be split into several chunks, and
    only the last one (``sample=True``) needs logits, unless the request asked for its
    prompt's logprobs (``all_logits=True``: a logits row for every token of the chunk).

        block_ids:  | b0 | b1 | b2 | b3 |          (block_size tokens each)
        positions:  0 ......... start_position ... start_position + len(token_ids)
                    └ cached / computed before ┘└── this chunk ──┘

    ``block_ids`` is the first KV group's table (the only one for most models);
    ``other_block_ids`` the other groups' (Gemma 3's windowed layers), in group order.

    A speculative decode step ends in ``num_draft_tokens`` drafts, written into the
    request's lookahead slots; each of its ``1 + num_draft_tokens`` rows is sampled
    (``engine/spec_decode/verification.py``)::

        token_ids:  | last token | d_0 | d_1 | d_2 |     logit rows: one per token
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    sample: bool
    all_logits: bool = False
    other_block_ids: tuple[list[int], ...] = ()
    num_draft_tokens: int = 0
    lora_id: str | None = None
    """The digest of the LoRA adapter the request runs (``model/lora/``), or None: the base
    model."""

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens :]

    @property
    def num_sample_rows(self) -> int:
        """Rows sampled: the last token's and each draft's (0 when the chunk samples none)."""
        return 1 + self.num_draft_tokens if self.sample else 0

    @property
    def block_tables(self) -> tuple[list[int], ...]:
        """Every KV group's block table, in group order."""
        return (self.block_ids, *self.other_block_ids)

    @property
    def num_logit_rows(self) -> int:
        """Rows of the step's logits this chunk gets: all its tokens, its sampled ones
        (its last, and its drafts), or none."""
        return len(self.token_ids) if self.all_logits else self.num_sample_rows
