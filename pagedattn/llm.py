"""The public engine API, as vLLM's `LLM` offers it: `LLM(...).generate(prompts, sampling_params)`
and `LLM(...).chat(messages, sampling_params)`, each -> [RequestOutput]."""

from __future__ import annotations

import numbers
import sys
import time
from collections.abc import Callable, Sequence

import torch

from pagedattn.engine.config import EngineConfig
from pagedattn.engine.llm_engine import LLMEngine
from pagedattn.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedattn.engine.sampling_params import GuidedDecodingParams, SamplingParams

__all__ = ["LLM", "CompletionOutput", "GuidedDecodingParams", "RequestMetrics", "RequestOutput", "SamplingParams",
           "apply_chat_template"]

Message = dict
"""One chat message: {"role": str, "content": str | list of {"type": "text", "text": str} | None, ...}."""


class LLM:
    """A model with a paged KV cache behind a continuous-batching engine (API.md section 6).

    model: None (the embedded SmolLM2-135M-Instruct), a Hugging Face folder (config.json +
        safetensors), a .gguf file, or a Hub id (org/name).
    tokenizer: take the tokenizer (and its chat template) from another folder, .gguf file or
        Hub id (None: the model's own).
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
    cascade_attention: where the requests of a step share a long cached prefix (a system prompt;
        >= 8 requests over >= 256 tokens), attend it once for all of them and each request's
        suffix apart, merged (FlashInfer's and vLLM's cascade attention). None: on CUDA (off on
        the CPU, where it does not pay); False: every step attends each request's whole context.
    tensor_parallel_size: shard the model over this many processes (one a GPU: rank r on
        cuda:r; or on the CPU over gloo), started here and ended by `shutdown()` (or when the LLM
        is collected, or at exit); under torchrun the ranks it started join instead. Llama,
        Mistral, Qwen2 and Gemma 2 families. A worker that dies makes `generate` raise a
        RuntimeError naming its rank. Scripts need the `if __name__ == "__main__":` guard
        (workers are spawned: they import the main module).
    Invalid values raise ValueError saying what was expected; a missing `[hf]` extra raises
    `MissingExtraError` (an ImportError) naming the `pip install` to run.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
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
        tensor_parallel_size: int = 1,
        cascade_attention: bool | None = None,
    ):
        self.config = EngineConfig(
            model=model,
            tokenizer=tokenizer,
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
            tensor_parallel_size=tensor_parallel_size,
            cascade_attention=cascade_attention,
        )
        self.engine = LLMEngine(self.config)

    def shutdown(self) -> None:
        """End the tensor-parallel workers (nothing without them); no `generate` after it."""
        self.engine.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's transformers tokenizer (vLLM's name for `tokenizer`)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable = True,
        lora_request=None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs in the prompts' order.

        A prompt is text, token ids, or vLLM's `{"prompt": text}` / `{"prompt_token_ids": ids}`;
        `prompts` is one prompt or a list of them.

        Encoder-decoder models (BART): a prompt is `{"encoder_prompt": ..., "decoder_prompt": ...}`
        (each text or token ids; the decoder prompt may be left out), or a plain prompt for the
        encoder, the decoder starting from the model's `decoder_start_token_id`. An audio
        encoder's (Whisper's) encoder prompt is `{"input_features": [num_mel_bins, frames]}`
        (a tensor or array, up to the model's window: 3000 frames, 30 s; not padded) or
        `{"audio": (waveform float [samples], sampling_rate)}` (mono, at the feature
        extractor's rate, 16 kHz; made into features padded to the window, as transformers
        does); text or token ids are refused there.

        `sampling_params`: one for all prompts, or one per prompt (default: `SamplingParams()`).
        `use_tqdm`: a progress bar on stderr, where it helps: on a terminal (or in a notebook)
        for several prompts or a prompt whose prefill takes several steps; a tqdm class (a
        callable) is used as given, always. `lora_request` and `priority` are vLLM's, accepted
        only as None (no LoRA, first-come first-served scheduling).

        A prompt that cannot run (longer than the context, bigger than the KV pool) gets
        finish_reason "error" and `RequestOutput.error`; the others complete.
        """
        _refuse_unsupported(lora_request=lora_request, priority=priority)
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
        progress = _progress_bar(use_tqdm, self.engine.runner.max_num_batched_tokens)
        try:
            return self.engine.generate(prompts, params, progress=progress)
        finally:
            if progress is not None:
                progress.close()

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or each of a list of conversations,
        through the chat template (`chat_template`, else the tokenizer's); one RequestOutput per
        conversation, its `prompt` the rendered text. Otherwise as `generate`.

        A message is a dict with "role" and "content" (a string, or OpenAI's list of
        `{"type": "text", "text": ...}` parts, joined by newlines). `add_generation_prompt`
        opens the assistant's turn; `continue_final_message` instead leaves the last message
        open for the model to continue. `tools` (JSON schemas) and `chat_template_kwargs` are
        passed to the template.
        """
        conversations = _conversations(messages)
        rendered = [
            apply_chat_template(
                self.tokenizer, conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools, chat_template_kwargs=chat_template_kwargs,
            )
            for conversation in conversations
        ]
        outputs = self.generate([{"prompt_token_ids": ids} for _, ids in rendered], sampling_params,
                                use_tqdm=use_tqdm, lora_request=lora_request)
        for output, (text, _) in zip(outputs, rendered):
            output.prompt = text
        return outputs


def apply_chat_template(
    tokenizer,
    messages: Sequence[Message],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict | None = None,
) -> tuple[str, list[int]]:
    """(text, token ids) of one conversation through `chat_template` (else the tokenizer's).
    The ids are the text's tokens without added special tokens (the template writes them), as
    transformers' `apply_chat_template(tokenize=True)` gives them."""
    if tokenizer is None:
        raise ValueError("expected a model with a tokenizer for a chat, got one without")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("expected a chat template, got a tokenizer without one: pass chat_template (a Jinja "
                         "template), or a tokenizer that has one")
    if add_generation_prompt and continue_final_message:
        raise ValueError("expected add_generation_prompt=False with continue_final_message=True (the last message "
                         "is continued, no new turn opened), got both True")
    text = tokenizer.apply_chat_template(
        [_message(m, i) for i, m in enumerate(messages)], chat_template=chat_template, tools=tools,
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
        tokenize=False, **(chat_template_kwargs or {}),
    )
    return text, list(tokenizer.encode(text, add_special_tokens=False))


def _conversations(messages) -> list[list[Message]]:
    """`messages` as a list of conversations: one conversation (a list of dicts) or several."""
    if isinstance(messages, (str, dict)) or not isinstance(messages, Sequence) or not messages:
        got = "an empty list" if isinstance(messages, Sequence) and not messages else type(messages).__name__
        raise ValueError(f"expected a conversation (a list of message dicts) or a list of them, got {got}")
    if all(isinstance(m, dict) for m in messages):
        return [list(messages)]
    for i, conversation in enumerate(messages):
        if isinstance(conversation, (str, dict)) or not isinstance(conversation, Sequence) or not conversation:
            raise ValueError(f"expected conversation {i} to be a non-empty list of message dicts, "
                             f"got {conversation!r:.60}")
    return [list(c) for c in messages]


def _message(message, index: int) -> Message:
    """A message as the template reads it: its content a string when it is OpenAI's text parts."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"expected message {index} to be a dict with a 'role' string, got {message!r:.80}")
    content = message.get("content")
    if isinstance(content, (list, tuple)):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"expected text content parts ({{'type': 'text', 'text': ...}}) in message {index}, "
                                 f"got {kind!r}")
            texts.append(part["text"])
        return {**message, "content": "\n".join(texts)}
    if content is not None and not isinstance(content, str):
        raise ValueError(f"expected message {index}'s content to be a string or a list of text parts, "
                         f"got {type(content).__name__}")
    return message


def _refuse_unsupported(*, lora_request, priority) -> None:
    if lora_request is not None:
        raise ValueError(f"expected lora_request=None (pagedattn serves no LoRA adapters), got {lora_request!r:.60}")
    if priority is not None:
        raise ValueError(f"expected priority=None (the scheduler is first-come first-served), got {priority!r:.60}")


def _progress_bar(use_tqdm, step_tokens: int) -> _ProgressBar | None:
    """The bar of `use_tqdm`: None when off, unavailable, or not on a terminal or notebook."""
    if use_tqdm is False or use_tqdm is None:
        return None
    if use_tqdm is not True:
        if not callable(use_tqdm):
            raise ValueError(f"expected use_tqdm to be a bool or a tqdm class, got {use_tqdm!r:.60}")
        return _ProgressBar(use_tqdm, step_tokens, always=True)
    try:
        from tqdm.autonotebook import tqdm
        from tqdm.std import tqdm as terminal_tqdm
    except ModuleNotFoundError:
        return None
    notebook = tqdm is not terminal_tqdm  # in a Jupyter kernel: tqdm's notebook widget
    if not notebook and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return None  # a log or a pipe: a bar would only litter it
    return _ProgressBar(tqdm, step_tokens, always=False)


class _ProgressBar:
    """vLLM's "Processed prompts" bar, and the prompt tokens computed while prefills run. Shown
    for several prompts, or one whose prefill takes several steps of `step_tokens` (else the
    bar would only jump from 0 to 1), unless `always`."""

    def __init__(self, tqdm_cls, step_tokens: int, *, always: bool):
        self.tqdm_cls = tqdm_cls
        self.step_tokens = step_tokens
        self.always = always
        self.bar = None
        self.off = False
        self.start = time.perf_counter()

    def __call__(self, groups) -> None:
        if self.off:
            return
        if self.bar is None:
            if not (self.always or len(groups) > 1 or any(len(g.prompt_token_ids) > self.step_tokens for g in groups)):
                self.off = True
                return
            self.bar = self.tqdm_cls(total=len(groups), desc="Processed prompts", dynamic_ncols=True)
        done = [g for g in groups if g.is_finished]
        self.bar.update(len(done) - self.bar.n)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        prompt_tokens = sum(len(g.prompt_token_ids) for g in done)
        output_tokens = sum(s.num_output_tokens for g in done for s in g.seqs)
        postfix = (f"est. speed input: {prompt_tokens / elapsed:.2f} toks/s, "
                   f"output: {output_tokens / elapsed:.2f} toks/s")
        prefilling = [g for g in groups
                      if not g.is_finished and g.seqs[0].num_computed_tokens < len(g.prompt_token_ids)]
        if prefilling:
            computed = sum(g.seqs[0].num_computed_tokens for g in prefilling)
            postfix = f"prefill: {computed}/{sum(len(g.prompt_token_ids) for g in prefilling)} tokens, {postfix}"
        self.bar.set_postfix_str(postfix)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
