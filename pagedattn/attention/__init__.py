"""The attention contract: types, metadata, builder, state, backend base and registry."""

from pagedattn.attention.backend import AttentionBackend, Capabilities
from pagedattn.attention.impl import AttentionImpl
from pagedattn.attention.builder import MetadataBuilder
from pagedattn.attention.merge import merge_attn_states
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.registry import BackendStatus, BackendUnavailableError, get_backend, list_backends
from pagedattn.attention.state import AttentionState
from pagedattn.attention.types import PAD_SLOT_ID, AttentionType, ScheduledSeq
from pagedattn.dtypes import kv_cache_dtype

__all__ = [
    "PAD_SLOT_ID",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionState",
    "AttentionType",
    "BackendStatus",
    "BackendUnavailableError",
    "Capabilities",
    "MetadataBuilder",
    "ScheduledSeq",
    "get_backend",
    "kv_cache_dtype",
    "list_backends",
    "merge_attn_states",
]
