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
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    sample: bool
    all_logits: bool = False
    other_block_ids: tuple[list[int], ...] = ()

    @property
    def block_tables(self) -> tuple[list[int], ...]:
        """Every KV group's block table, in group order."""
        return (self.block_ids, *self.other_block_ids)

    @property
    def num_logit_rows(self) -> int:
        """Rows of the step's logits this chunk gets: all its tokens, its last, or none."""
        return len(self.token_ids) if self.all_logits else int(self.sample)
