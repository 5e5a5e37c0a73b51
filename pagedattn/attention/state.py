"""The common CUDA-graph state: persistent decode buffers that captured graphs read."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from pagedattn.attention.impl import layers_of
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.types import PAD_SLOT_ID

_GRAPH_INPUTS = ("slot_mapping", "seq_lens_tensor", "context_lens_tensor", "seq_start_loc", "block_tables")


class AttentionState:
    """Per-runner state for CUDA graphs (API.md section 5), enough for backends that need no more.

    Buffers live as long as the state (and its clones, which share them), sized for
    `max_batch_size` sequences of up to `max_blocks_per_seq` blocks.
    """

    backend: type | None = None  # the AttentionBackend whose `get_metadata_cls()` graphs read
    # Whether a graph captured with these buffers may also hold a cascade's shared-prefix part:
    # `build_shared_prefix` metadata made for capture (`use_cuda_graph=True`, the longest prefix),
    # its device tensors rewritten before each replay; the launches read only device lengths.
    shared_prefix_graphs: bool = True

    @property
    def metadata_cls(self) -> type[AttentionMetadata]:
        return AttentionMetadata if self.backend is None else self.backend.get_metadata_cls()

    def set_layers(self, impls) -> None:
        """The attention impls (`AttentionImpl`) of the model that graphs capture. Optional:
        backends that plan per layer setting (FlashInfer) plan these for capture and replay;
        the others only check them."""
        layers_of(self.backend, impls)

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, block_size: int, device: torch.device | str):
        if max_batch_size < 1 or max_blocks_per_seq < 1 or block_size < 1:
            raise ValueError(
                "expected max_batch_size, max_blocks_per_seq, block_size >= 1, got "
                f"{max_batch_size}, {max_blocks_per_seq}, {block_size}"
            )
        self.max_batch_size = max_batch_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = torch.device(device)
        self._buffers: dict[str, torch.Tensor] | None = None
        self._capturing = False

    def _allocate(self) -> dict[str, torch.Tensor]:
        n, dev = self.max_batch_size, self.device
        return {
            "slot_mapping": torch.full((n,), PAD_SLOT_ID, dtype=torch.int64, device=dev),
            "seq_lens_tensor": torch.ones(n, dtype=torch.int32, device=dev),
            "context_lens_tensor": torch.zeros(n, dtype=torch.int32, device=dev),
            "query_start_loc": torch.arange(n + 1, dtype=torch.int32, device=dev),
            "seq_start_loc": torch.arange(n + 1, dtype=torch.int32, device=dev),
            "block_tables": torch.zeros(n, self.max_blocks_per_seq, dtype=torch.int32, device=dev),
        }

    @contextlib.contextmanager
    def graph_capture(self, max_batch_size: int) -> Iterator[AttentionState]:
        if max_batch_size > self.max_batch_size:
            raise ValueError(f"expected max_batch_size <= {self.max_batch_size}, got {max_batch_size}")
        if self._buffers is None:
            self._buffers = self._allocate()
        self._capturing = True
        try:
            yield self
        finally:
            self._capturing = False

    def graph_capture_get_metadata_for_batch(self, batch_size: int) -> AttentionMetadata:
        """Decode-only metadata over the persistent buffers, for capturing a graph of `batch_size`."""
        if self._buffers is None:
            raise RuntimeError("call graph_capture_get_metadata_for_batch inside graph_capture()")
        if not 1 <= batch_size <= self.max_batch_size:
            raise ValueError(f"expected 1 <= batch_size <= {self.max_batch_size}, got {batch_size}")
        b = self._buffers
        md = self.metadata_cls(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decode_tokens=batch_size,
            block_size=self.block_size,
            slot_mapping=b["slot_mapping"][:batch_size],
            seq_lens=[1] * batch_size,
            query_lens=[1] * batch_size,
            seq_lens_tensor=b["seq_lens_tensor"][:batch_size],
            context_lens_tensor=b["context_lens_tensor"][:batch_size],
            query_start_loc=b["query_start_loc"][: batch_size + 1],
            seq_start_loc=b["seq_start_loc"][: batch_size + 1],
            block_tables=b["block_tables"][:batch_size],
            max_query_len=1,
            max_prefill_seq_len=0,
            # Kernels size their key loop from this host int; a graph must cover any length.
            max_decode_seq_len=self.max_blocks_per_seq * self.block_size,
            use_cuda_graph=True,
        )
        self._extend_capture_metadata(md)
        return md

    def _extend_capture_metadata(self, md: AttentionMetadata) -> None:
        """Hook for backends whose metadata carries more graph inputs."""

    def get_graph_input_buffers(self, attn_metadata: AttentionMetadata) -> dict[str, torch.Tensor]:
        return {name: getattr(attn_metadata, name) for name in _GRAPH_INPUTS}

    def prepare_graph_input_buffers(self, input_buffers: dict[str, torch.Tensor], attn_metadata: AttentionMetadata) -> None:
        """Copy the real step's inputs into the captured buffers (in place, non-blocking)."""
        md = attn_metadata
        n = input_buffers["slot_mapping"].shape[0]
        if md.num_prefills or md.num_seqs != n:
            raise ValueError(
                f"expected a decode-only batch padded to {n} sequences (cuda_graph_pad_to={n}), "
                f"got {md.num_prefills} prefills and {md.num_seqs} sequences"
            )
        width = md.block_tables.shape[1]
        if width > self.max_blocks_per_seq:
            raise ValueError(f"expected block tables of <= {self.max_blocks_per_seq} blocks, got {width}")
        for name in _GRAPH_INPUTS:
            src, dst = getattr(md, name), input_buffers[name]
            if name == "block_tables":
                dst = dst[:, :width]
            dst.copy_(src, non_blocking=True)

    def begin_forward(self, attn_metadata: AttentionMetadata) -> None:
        """Per-step planning hook; the common state plans nothing."""

    def graph_clone(self, batch_size: int) -> AttentionState:
        """A state for one captured batch size; it shares this state's buffers."""
        clone = type(self)(self.max_batch_size, self.max_blocks_per_seq, self.block_size, self.device)
        clone._buffers = self._buffers
        return clone
