"""glassbox's serving core: ``from engine import LLM, SamplingParams``."""

from engine.llm_engine import LLM, LLMEngine
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams"]
