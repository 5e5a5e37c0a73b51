"""Triton kernels of pagedattn: one file per kernel family, one checked launcher each.

Importing this package imports triton; the rest of the library imports it lazily.
"""

from .advance_step import advance_step
from .copy_blocks import copy_blocks
from .merge_attn_states import merge_attn_states
from .paged_attention import paged_attention
from .split_kv import SplitKVWorkspace, reduce_splits, shared_workspace
from .store_kv import KVWrite, store_kv

__all__ = [
    "KVWrite",
    "SplitKVWorkspace",
    "advance_step",
    "copy_blocks",
    "merge_attn_states",
    "paged_attention",
    "reduce_splits",
    "shared_workspace",
    "store_kv",
]
