"""Per-step attention metadata: built once per step by a builder, shared by every layer.

Token layout of a step: `[prefill tokens | decode tokens | CUDA-graph padding]`; prefills come
first. Device tensors describe the batch for kernels; host ints/lists (`seq_lens`, `query_lens`,
the `max_*` values, `max_block_id`) size launches and check inputs without a device
synchronisation. Every fact is a named field, computed once by the builder (or the graph state).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedattn.attention.types import PAD_SLOT_ID
from pagedattn.kv_cache import StorePlan, plan_store


@dataclass
class AttentionMetadata:
    """The common metadata of every backend (API.md section 2).

    Shapes: `T` tokens, `B` sequences (graph padding included), `W` blocks per table row.
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    block_size: int
    slot_mapping: torch.Tensor  # int64 [T]; -1 = write nothing
    seq_lens: list[int]  # host [B]; after sliding-window trimming
    query_lens: list[int]  # host [B]
    seq_lens_tensor: torch.Tensor  # int32 [B]
    context_lens_tensor: torch.Tensor  # int32 [B]
    query_start_loc: torch.Tensor  # int32 [B+1]
    seq_start_loc: torch.Tensor  # int32 [B+1]
    block_tables: torch.Tensor  # int32 [B, W]
    max_query_len: int
    max_prefill_seq_len: int
    max_decode_seq_len: int
    use_cuda_graph: bool = False
    # The decode part's start locations re-based to 0 (int32 [B - num_prefills + 1]), for
    # `decode_metadata`; None when the step has no prefill (the step's own are already).
    decode_query_start_loc: torch.Tensor | None = None
    decode_seq_start_loc: torch.Tensor | None = None
    # Host facts that let `forward` check and skip work without reading the device:
    slots_all_real: bool = False  # no slot is -1 (a store needs no padding guard); stays exact under advance_step
    max_block_id: int = 0  # the largest block id in `block_tables` (checked against the cache's pool)
    fresh_prefills: bool = False  # every prefill is a fresh prompt (context_len 0): its keys are the step's own
    # Encoder-decoder models: the encoder tokens of the step are those of its prefills.
    num_encoder_tokens: int = 0
    encoder_seq_lens: list[int] | None = None  # host [B]
    encoder_seq_lens_tensor: torch.Tensor | None = None  # int32 [B]
    encoder_seq_start_loc: torch.Tensor | None = None  # int32 [num_prefills+1]
    max_encoder_seq_len: int = 0
    cross_slot_mapping: torch.Tensor | None = None  # int64 [num_encoder_tokens]
    cross_block_tables: torch.Tensor | None = None  # int32 [B, W_cross]
    max_cross_block_id: int = 0  # the largest block id in `cross_block_tables`
    # Made by `build_shared_prefix`: a cascade's shared part, whose queries have no block of their
    # own (block_tables [1, 0] under seq_lens [T]); only cross-attention (ENCODER_DECODER) reads it.
    is_shared_prefix: bool = False
    # Built on first use and kept for the step's other layers (`advance_step` drops what it changes):
    # the prefill/decode views, and where the PyTorch store writes each slot.
    _prefill_view: AttentionMetadata | None = field(default=None, repr=False, compare=False)
    _decode_view: AttentionMetadata | None = field(default=None, repr=False, compare=False)
    _store_plan: StorePlan | None = field(default=None, repr=False, compare=False)
    _cross_store_plan: StorePlan | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_seqs(self) -> int:
        return self.seq_lens_tensor.shape[0]

    @property
    def prefill_metadata(self) -> AttentionMetadata | None:
        """The prefill-only part of the step (cached), or None when the step has no prefill."""
        if self.num_prefills == 0:
            return None
        if self.num_decode_tokens == 0:
            return self
        if self._prefill_view is None:
            self._prefill_view = self._slice(prefill=True)
        return self._prefill_view

    @property
    def decode_metadata(self) -> AttentionMetadata | None:
        """The decode-only part of the step (cached; start locations re-based to 0), or None."""
        if self.num_decode_tokens == 0:
            return None
        if self.num_prefills == 0:
            return self
        if self._decode_view is None:
            self._decode_view = self._slice(prefill=False)
        return self._decode_view

    def store_plan(self) -> StorePlan:
        """Where `kv_cache.store_kv` writes the step's `slot_mapping` (kept for the step's layers)."""
        if self._store_plan is not None:
            return self._store_plan
        plan = plan_store(self.slot_mapping, self.block_size, self.slots_all_real)
        if not self.use_cuda_graph:  # a graph's buffers change between replays: recompute in the graph
            self._store_plan = plan
        return plan

    def cross_store_plan(self) -> StorePlan:
        """Where `kv_cache.store_kv` writes `cross_slot_mapping` (kept for the step's layers)."""
        if self._cross_store_plan is None:
            self._cross_store_plan = plan_store(self.cross_slot_mapping, self.block_size)
        return self._cross_store_plan

    def _slice(self, prefill: bool) -> AttentionMetadata:
        """A view of the prefill or decode part. Subclasses whose fields describe the whole
        batch reset them through `_part_fields`."""
        p, pt = self.num_prefills, self.num_prefill_tokens
        seqs = slice(None, p) if prefill else slice(p, None)
        enc = self.encoder_seq_lens_tensor
        changes: dict[str, Any] = dict(
            num_prefills=p if prefill else 0,
            num_prefill_tokens=pt if prefill else 0,
            num_decode_tokens=0 if prefill else self.num_decode_tokens,
            slot_mapping=self.slot_mapping[:pt] if prefill else self.slot_mapping[pt:],
            seq_lens=self.seq_lens[seqs],
            query_lens=self.query_lens[seqs],
            seq_lens_tensor=self.seq_lens_tensor[seqs],
            context_lens_tensor=self.context_lens_tensor[seqs],
            block_tables=self.block_tables[seqs],
            max_query_len=self.max_query_len if prefill else 1,
            max_prefill_seq_len=self.max_prefill_seq_len if prefill else 0,
            max_decode_seq_len=0 if prefill else self.max_decode_seq_len,
            use_cuda_graph=False if prefill else self.use_cuda_graph,
            decode_query_start_loc=None,
            decode_seq_start_loc=None,
            num_encoder_tokens=self.num_encoder_tokens if prefill else 0,
            encoder_seq_lens=None if self.encoder_seq_lens is None else self.encoder_seq_lens[seqs],
            encoder_seq_lens_tensor=None if enc is None else enc[seqs],
            encoder_seq_start_loc=self.encoder_seq_start_loc if prefill else None,
            cross_slot_mapping=self.cross_slot_mapping if prefill else None,
            cross_block_tables=None if self.cross_block_tables is None else self.cross_block_tables[seqs],
            _prefill_view=None,
            _decode_view=None,
            _store_plan=None,
            _cross_store_plan=None,
        )
        if prefill:
            changes["query_start_loc"] = self.query_start_loc[: p + 1]
            changes["seq_start_loc"] = self.seq_start_loc[: p + 1]
        else:
            changes["query_start_loc"] = self.decode_query_start_loc
            changes["seq_start_loc"] = self.decode_seq_start_loc
        if self.encoder_seq_lens is not None and not prefill:
            changes["max_encoder_seq_len"] = max(self.encoder_seq_lens[p:], default=0)
        changes.update(self._part_fields())
        return dataclasses.replace(self, **changes)

    def _part_fields(self) -> dict[str, Any]:
        """Fields of a subclass to reset in a part's view (the per-step caches of the whole batch)."""
        return {}

    def advance_step(
        self,
        input_tokens: torch.Tensor,
        input_positions: torch.Tensor,
        sampled_token_ids: torch.Tensor,
        block_size: int,
        num_seqs: int,
        num_queries: int,
    ) -> None:
        """Advance a decode-only batch by one token, in place on the device, with no host sync.

        Args:
            input_tokens: int64 [num_seqs]; rows < num_queries receive the sampled tokens.
            input_positions: int64 [num_seqs]; rows < num_queries advance by one.
            sampled_token_ids: int64 [num_queries, 1].
            block_size: tokens per block; must equal the builder's.
            num_seqs: rows of the batch, graph padding included.
            num_queries: real sequences; rows num_queries..num_seqs are padding (slot -1).
        The block tables must already hold the block of each new position (lookahead blocks).
        """
        self._check_advance(input_tokens, input_positions, sampled_token_ids, block_size, num_seqs, num_queries)
        self._advance_device(input_tokens, input_positions, sampled_token_ids, block_size, num_seqs, num_queries)
        steps = torch.arange(1, num_seqs + 1, device=self.seq_start_loc.device, dtype=torch.int32)
        self.seq_start_loc[1:] += steps.clamp_(max=num_queries)
        self._advance_host(num_queries, num_seqs)

    def _advance_device(self, input_tokens, input_positions, sampled_token_ids, block_size, num_seqs, n) -> None:
        """Tokens, positions, lengths and slots of the first `n` rows; padding rows get slot -1."""
        input_tokens[:n].copy_(sampled_token_ids[:n, 0])
        input_positions[:n] += 1
        self.seq_lens_tensor[:n] += 1
        self.context_lens_tensor[:n] += 1
        pos = self.seq_lens_tensor[:n].long() - 1  # [n] position of the new token
        blocks = self.block_tables[:n].gather(1, (pos // block_size).unsqueeze(1)).squeeze(1)
        self.slot_mapping[:n] = blocks.long() * block_size + pos % block_size
        self.slot_mapping[n:num_seqs] = PAD_SLOT_ID

    def _check_advance(self, input_tokens, input_positions, sampled_token_ids, block_size, num_seqs, num_queries):
        if self.num_prefills:
            raise ValueError(f"advance_step needs a decode-only batch, got num_prefills={self.num_prefills}")
        if block_size != self.block_size:
            raise ValueError(f"expected block_size={self.block_size} (the builder's), got {block_size}")
        if num_seqs != self.num_seqs or not 0 <= num_queries <= num_seqs:
            raise ValueError(
                f"expected num_seqs={self.num_seqs} and 0 <= num_queries <= num_seqs, "
                f"got num_seqs={num_seqs}, num_queries={num_queries}"
            )
        for name, t in (("input_tokens", input_tokens), ("input_positions", input_positions)):
            if t.dtype != torch.int64 or t.shape[0] < num_seqs:
                raise ValueError(f"expected {name} int64 [>= {num_seqs}], got {t.dtype} {list(t.shape)}")
        if sampled_token_ids.dim() != 2 or sampled_token_ids.shape[0] < num_queries:
            raise ValueError(
                f"expected sampled_token_ids [{num_queries}, 1], got {list(sampled_token_ids.shape)}"
            )

    def _advance_host(self, n: int, num_seqs: int) -> None:
        for i in range(n):
            self.seq_lens[i] += 1
        if n:
            self.max_decode_seq_len = max(self.seq_lens[:n])
        # Rows n..num_seqs now hold slot -1: a store must guard them from here on.
        self.slots_all_real = self.slots_all_real and n == num_seqs
        self._decode_view = None
        self._store_plan = None
        for name, value in self._part_fields().items():
            setattr(self, name, value)
