"""Model families over the paged KV cache, and the loader that builds them from a checkpoint.

The registry maps a Hugging Face architecture name to the module defining our class of the same
name; a family's module (and torch.nn model code) is imported only when that architecture is used.
"""

from __future__ import annotations

import importlib

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "pagedattn.models.llama",
    "MistralForCausalLM": "pagedattn.models.llama",
    "Qwen2ForCausalLM": "pagedattn.models.llama",
    "Qwen3ForCausalLM": "pagedattn.models.qwen3",
    "Gemma2ForCausalLM": "pagedattn.models.gemma2",
    "Gemma3ForCausalLM": "pagedattn.models.gemma3",
    "Gemma3ForConditionalGeneration": "pagedattn.models.gemma3",
    "GptOssForCausalLM": "pagedattn.models.gpt_oss",
    "BartForConditionalGeneration": "pagedattn.models.bart",
    "WhisperForConditionalGeneration": "pagedattn.models.whisper",
}
"""Supported architecture name -> module holding the class of that name."""


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one of `ARCHITECTURES`."""


def get_model_cls(architecture: str) -> type:
    """The model class of a Hugging Face architecture name (e.g. "LlamaForCausalLM")."""
    module = ARCHITECTURES.get(architecture)
    if module is None:
        raise UnsupportedModelError(
            f"expected an architecture in {sorted(ARCHITECTURES)}, got {architecture!r}"
        )
    return getattr(importlib.import_module(module), architecture)


def __getattr__(name: str):
    # The loader pulls in transformers; import it only when asked for.
    if name in ("load_model", "LoadedModel", "ModelSpec", "default_model_path"):
        from pagedattn.models import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'pagedattn.models' has no attribute {name!r}")


__all__ = [
    "ARCHITECTURES",
    "LoadedModel",
    "ModelSpec",
    "UnsupportedModelError",
    "default_model_path",
    "get_model_cls",
    "load_model",
]
