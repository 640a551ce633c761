"""What a decode worker's prewarm handshakes came to, for the gateway's ``/ready``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PrewarmResult:
    """``connected``: the prefill addresses handshaken with. ``refused``: address → why the
    pair can never exchange KV (their layouts or models differ; the message names both
    sides' values). An address in neither did not answer and is tried again."""

    connected: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
