"""pagedattn: attention backends for LLM inference over a paged KV cache, and an engine on top.

Importing this package imports torch only; optional dependencies load with the backend or
model that needs them.
"""

from pagedattn.attention import (
    PAD_SLOT_ID,
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionState,
    AttentionType,
    BackendStatus,
    BackendUnavailableError,
    MetadataBuilder,
    ScheduledSeq,
    get_backend,
    kv_cache_dtype,
    list_backends,
    merge_attn_states,
)
from pagedattn.layer import Attention, forward_context

__version__ = "0.1.0"

_ENGINE = {"LLM", "SamplingParams", "GuidedDecodingParams", "RequestOutput", "CompletionOutput"}


def __getattr__(name: str):
    # The engine pulls in transformers; load it only when asked for.
    if name in _ENGINE:
        from pagedattn import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'pagedattn' has no attribute {name!r}")


__all__ = [
    "PAD_SLOT_ID",
    "Attention",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionState",
    "AttentionType",
    "BackendStatus",
    "BackendUnavailableError",
    "CompletionOutput",
    "GuidedDecodingParams",
    "LLM",
    "MetadataBuilder",
    "RequestOutput",
    "SamplingParams",
    "ScheduledSeq",
    "forward_context",
    "get_backend",
    "kv_cache_dtype",
    "list_backends",
    "merge_attn_states",
]
