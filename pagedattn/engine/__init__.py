"""The continuous-batching engine: config, scheduler, block manager, model runner, sampler.

`pagedattn.LLM` is the public entry point; `LLMEngine` is the step-by-step loop under it:
`InputProcessor` turns a request into a `SequenceGroup`; each step, `Scheduler.schedule()`
emits `ScheduledChunk`s (each with the `ScheduledSeq` the metadata builder gets),
`ModelRunner.launch()` queues their model run and sampling (`LaunchedStep`, whose `results()`
are `StepResult`s), and `OutputProcessor` appends the tokens, finishes, forks and steps beams,
and makes the `RequestOutput`s. With async scheduling the next decode step is launched before
the current one's results are read (`Scheduler.schedule_next_decodes`).
"""

from pagedattn.engine.config import EngineConfig
from pagedattn.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedattn.engine.sampling_params import GuidedDecodingParams, SamplingParams

__all__ = ["CompletionOutput", "EngineConfig", "GuidedDecodingParams", "Logprob", "RequestMetrics", "RequestOutput",
           "SamplingParams"]
