"""What both worker kinds run: request, scheduler, model runner, and the colocated engine."""

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.engine_stats import EngineStats
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request_output import RequestOutput
from pdserve.engine.sampling_params import SamplingParams

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]
