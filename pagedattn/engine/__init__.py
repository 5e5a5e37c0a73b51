"""The continuous-batching engine: config, scheduler, block manager, model runner, sampler.

`pagedattn.LLM` is the public entry point; `LLMEngine` is the step-by-step loop under it.
"""

from pagedattn.engine.config import EngineConfig
from pagedattn.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedattn.engine.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "EngineConfig", "RequestMetrics", "RequestOutput", "SamplingParams"]
