"""The public engine API: `LLM(...).generate(prompts, sampling_params) -> [RequestOutput]`."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from pagedattn.engine.config import EngineConfig
from pagedattn.engine.llm_engine import LLMEngine
from pagedattn.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedattn.engine.sampling_params import GuidedDecodingParams, SamplingParams

__all__ = ["LLM", "CompletionOutput", "GuidedDecodingParams", "RequestMetrics", "RequestOutput", "SamplingParams"]


class LLM:
    """A model with a paged KV cache behind a continuous-batching engine (API.md section 6).

    model: None (the embedded SmolLM2-135M-Instruct), a Hugging Face folder (config.json +
        safetensors) or a .gguf file.
    backend: an attention backend name ("auto": the best for the device; "torch" on the CPU).
    device: "auto" (CUDA when present), "cpu", "cuda", "cuda:N". dtype: "auto" (float32 on the
        CPU, the model's half precision on CUDA), "float32", "bfloat16", "float16".
    block_size: tokens per KV-cache block. kv_cache_dtype: "auto", "fp8", "fp8_e4m3", "fp8_e5m2".
    max_num_seqs / max_num_batched_tokens: sequences / tokens per step (tokens default to 2048
        on the CPU and 8192 on CUDA with chunked prefill, else to the model's context if larger).
    enable_prefix_caching: reuse cached KV blocks of identical prompt prefixes.
    enable_chunked_prefill: split long prompts across steps, batched with decodes.
    num_scheduler_steps: decode steps run back to back on the device per scheduling.
    async_scheduling: queue each decode step before the previous one's tokens reach the host,
        hiding the host's work behind the device's (None: on CUDA unless num_scheduler_steps > 1).
    enforce_eager: never capture CUDA graphs.
    swap_space_gib: CPU memory for sequences preempted by swapping (0: always recompute).
    gpu_memory_utilization: fraction of device memory the model, activations and KV cache may use.
    num_kv_blocks: fixes the KV pool size instead of sizing it from memory (a pool sized from
        memory must hold one request of `max_model_len` tokens, else ValueError says which
        knob to raise).
    max_model_len: caps the context (prompt + completion) below the model's own; a smaller
        context needs a smaller KV pool.
    seed: seeds the sampling of requests that have no seed of their own.
    Invalid values raise ValueError saying what was expected; a missing `[hf]` extra raises
    `MissingExtraError` (an ImportError) naming the `pip install` to run.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        backend: str = "auto",
        device: str = "auto",
        dtype: str | torch.dtype = "auto",
        block_size: int = 16,
        kv_cache_dtype: str = "auto",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        num_scheduler_steps: int = 1,
        async_scheduling: bool | None = None,
        enforce_eager: bool = False,
        swap_space_gib: float = 4,
        gpu_memory_utilization: float = 0.9,
        num_kv_blocks: int | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
    ):
        self.config = EngineConfig(
            model=model,
            backend=backend,
            device=device,
            dtype=dtype,
            block_size=block_size,
            kv_cache_dtype=kv_cache_dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            num_scheduler_steps=num_scheduler_steps,
            async_scheduling=async_scheduling,
            enforce_eager=enforce_eager,
            swap_space_gib=swap_space_gib,
            gpu_memory_utilization=gpu_memory_utilization,
            num_kv_blocks=num_kv_blocks,
            max_model_len=max_model_len,
            seed=seed,
        )
        self.engine = LLMEngine(self.config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Complete every prompt (text, or token ids); outputs in the prompts' order.

        Encoder-decoder models (BART): a prompt is `{"encoder_prompt": ..., "decoder_prompt": ...}`
        (each text or token ids; the decoder prompt may be left out), or a plain prompt for the
        encoder, the decoder starting from the model's `decoder_start_token_id`. An audio
        encoder's (Whisper's) encoder prompt is `{"input_features": [num_mel_bins, frames]}`
        (a tensor or array, up to the model's window: 3000 frames, 30 s; not padded) or
        `{"audio": (waveform float [samples], sampling_rate)}` (mono, at the feature
        extractor's rate, 16 kHz; made into features padded to the window, as transformers
        does); text or token ids are refused there.

        `sampling_params`: one for all prompts, or one per prompt. A prompt that cannot run
        (longer than the context, bigger than the KV pool) gets finish_reason "error" and
        `RequestOutput.error`; the others complete.
        """
        # A flat list of numbers is one prompt of token ids (floats in it are refused per request).
        if isinstance(prompts, (str, dict)) or (prompts and all(isinstance(t, numbers.Number) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"expected {len(prompts)} sampling params (one per prompt), got {len(params)}")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"expected SamplingParams at index {i}, got {type(p).__name__}")
        return self.engine.generate(prompts, params, use_tqdm=use_tqdm)
