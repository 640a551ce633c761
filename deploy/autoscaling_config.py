"""The ``autoscaling:`` settings of an app: latency targets and worker bounds per role, and
how eagerly the autoscaler moves (``deploy/autoscaler.py``; off when the key is absent).

    autoscaling:
      ttft_p90_ms: 2000        # time to first token, from arrival (queue wait included)
      itl_p90_ms: 60           # time between output tokens after a reply's second
      min_prefill: 1
      max_prefill: 8
      min_decode: 1
      max_decode: 8
      look_back_s: 30          # the window every measure is taken over
      scale_up_delay_s: 10     # "more" must be wanted this long before workers are added
      scale_down_delay_s: 60   # "fewer" this long before workers are drained and removed
      max_step: 2              # workers added or removed per role per step
      max_scale_down_rate: 2   # a step down keeps at least 1/2 of the role's workers
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class AutoscalingConfig(BaseModel):
    """Targets and bounds for ``ScalingPolicy``; see the module docstring for the YAML."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_p90_ms: float = Field(gt=0, description="p90 time to first token, from arrival")
    itl_p90_ms: float = Field(
        gt=0,
        description="p90 time between output tokens after a reply's second (the decode steps' "
        "pace; the first gap, in P/D the hand-off's, is TTFT's neighbour, not decode's)",
    )
    min_prefill: int = Field(1, ge=1)
    max_prefill: int = Field(4, ge=1)
    min_decode: int = Field(1, ge=1)
    max_decode: int = Field(4, ge=1)
    look_back_s: float = Field(30.0, gt=0, description="the window measures are taken over")
    interval_s: float = Field(2.0, gt=0, description="how often the service is read")
    scale_up_delay_s: float = Field(10.0, ge=0)
    scale_down_delay_s: float = Field(60.0, ge=0)
    max_step: int = Field(2, ge=1, description="workers added or removed per role per step")
    max_scale_down_rate: float = Field(
        2.0,
        ge=1,
        description="a step down keeps at least 1/this of the role's workers (Knative's "
        "max-scale-down-rate); an idle role still returns to min in one step",
    )
    prefill_utilization: float = Field(
        0.7,
        gt=0,
        le=1,
        description="the busy share a prefill worker is sized for (queues grow fast above it)",
    )
    max_kv_usage: float = Field(
        0.85, gt=0, le=1, description="decode KV usage above which a worker is added"
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingConfig:
        for role in ("prefill", "decode"):
            low, high = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
            if low > high:
                raise ValueError(f"autoscaling: min_{role} {low} is above max_{role} {high}")
        return self

    def bounds(self, role: str) -> tuple[int, int]:
        """(min, max) workers of ``role`` ("prefill" or "decode")."""
        return getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
