"""What `generate` returns: one `RequestOutput` per prompt, one `CompletionOutput` per completion."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """One token's log-probability under the model (log_softmax of its logits before bias,
    penalties and temperature), its rank in that distribution (1: the most likely) and its text
    alone (`tokenizer.decode([id])`, None without a tokenizer), as vLLM's `Logprob`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated token: the drawn token's `Logprob` first, then the `logprobs` most likely ones."""
PromptLogprobs = list[dict[int, Logprob] | None]
"""Per prompt token (None for the first, which nothing predicts): its `Logprob` first, then the
`prompt_logprobs` most likely ones at its position."""


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    """"stop" (EOS or a stop string), "length" (max_tokens or the model's context), "error",
    "abort" (`LLMEngine.abort_request`, e.g. a server client that went away), or None while running."""
    cumulative_logprob: float
    """Sum of the model's log-probabilities (unscaled by temperature) of `token_ids`."""
    logprobs: SampleLogprobs | None = None
    """One dict per token of `token_ids` when `SamplingParams.logprobs` is set, else None."""
    stop_reason: int | str | None = None
    """What ended a "stop" completion, as vLLM: the stop token id or stop string; None for EOS
    (and any other finish)."""


@dataclass
class RequestMetrics:
    """Wall-clock times (`time.perf_counter()` seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    """Why the request finished with finish_reason "error" (e.g. a prompt longer than the context)."""
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    """An encoder-decoder request's encoder prompt (then `prompt`/`prompt_token_ids` are the
    decoder's, its start token included); None for decoder-only models."""
    prompt_logprobs: PromptLogprobs | None = None
    """One entry per prompt token when `SamplingParams.prompt_logprobs` is set (filled as the
    prompt is computed), else None."""
