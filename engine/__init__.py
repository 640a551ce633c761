"""What both worker kinds run: request, scheduler, model runner, and the colocated engine."""

from pdserve.engine.engine_stats import EngineStats
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request_output import RequestOutput
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.sampling_params import SamplingParams

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]
