"""chatapp's inference engine: paged KV cache, prefix caching, FCFS scheduling with preemption."""

from chatapp.engine.config import EngineConfig
from chatapp.engine.llm import LLM
from chatapp.engine.outputs import CompletionOutput, RequestOutput
from chatapp.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
