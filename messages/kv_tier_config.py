"""How one worker's KV tier behaves (the blocks its pool evicts), in one typed place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class KVTierConfig:
    """A second KV tier below the block pool: host memory, disk, or both (stacked).

    ```
    block pool (device) ──evicted (or filled: write_through)──▶ cpu tier ──its LRU──▶ disk tier
            ▲                                                      │                   │
            └──────────── prefix hit past the pool: loaded back ◀──┴───────────────────┘
    ```

    A disk tier starts empty: files left by an earlier run are deleted at start (their
    checksums lived in that run's memory).
    """

    cpu_bytes: int = 0
    """Host memory per worker for blocks evicted from the pool (0: no cpu tier); pinned when
    the pool is on a GPU."""
    disk_path: str | None = None
    """A directory for a disk tier; each app and worker keeps its pages in its own
    subdirectory (``<disk_path>/<app>/<worker>``, owner-only), emptied at start and deleted
    when the worker stops (unset: no disk tier)."""
    disk_bytes: int = 0
    """The disk tier's budget per worker."""
    write_through: bool = False
    """Copy each block to the tier when it fills, not only when evicted, so an eviction costs
    nothing on the step path (but every full block is copied once)."""

    def __post_init__(self) -> None:
        if self.cpu_bytes < 0 or self.disk_bytes < 0:
            raise ValueError(
                f"cpu_bytes and disk_bytes must be >= 0, got {self.cpu_bytes} and {self.disk_bytes}"
            )
        if self.disk_path is not None and self.disk_bytes == 0:
            raise ValueError(f"a disk tier at {self.disk_path!r} needs disk_bytes > 0")
        if self.disk_path is None and self.disk_bytes:
            raise ValueError("disk_bytes is set but disk_path is not: where should pages go?")

    @property
    def enabled(self) -> bool:
        return self.cpu_bytes > 0 or self.disk_path is not None
