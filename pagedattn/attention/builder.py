"""The common metadata builder: host-side work of a step, then one copy of each dtype to the device."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Sequence

import torch

from pagedattn.attention.impl import layers_of
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.types import PAD_SLOT_ID, ScheduledSeq, window_start_block
from pagedattn.intmath import cdiv, cumsum

_VIEW_ALIGN_BYTES = 16  # what Triton checks a pointer argument for
_BLOCK_ID_END = 2**31  # block ids are int32 in the tables (DESIGN.md, "KV cache")


def _check_block_ids(i: int | None, what: str, ids: Sequence) -> None:
    """Each of `ids` an int in [0, 2**31) (tables are int32), not a bool (`operator.index` takes
    True as block 1); else a ValueError naming sequence `i` (None: no sequence) and the bad id."""
    if isinstance(ids, torch.Tensor) and ids.dtype == torch.bool:
        raise ValueError(f"{_of_seq(i)}expected {what} ids that are ints, got a torch.bool tensor {ids.tolist()}")
    index = operator.index
    for b in ids:
        try:
            ok = type(b) is not bool and 0 <= index(b) < _BLOCK_ID_END
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"{_of_seq(i)}expected {what} ids that are ints in [0, 2**31), got {b!r} in {list(ids)}")


def _of_seq(i: int | None) -> str:
    return "" if i is None else f"sequence {i}: "


def _slots(block_table: Sequence[int], start: int, stop: int, block_size: int) -> list[int]:
    """Slots of positions [start, stop) of a sequence with this block table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, stop)]


class MetadataBuilder:
    """Turns a step's `[ScheduledSeq]` (prefills first) into `AttentionMetadata` on `device`.

    With `sliding_window`, leading blocks that no query of the step can see are dropped from the
    tables; the sequence's positions shift by whole blocks, so results do not change.
    A backend's builder names the backend (`backend`), whose `get_metadata_cls()` is the class
    built; backends that add fields override `_extend`.
    """

    backend: type | None = None  # the AttentionBackend; None: the common AttentionMetadata

    def __init__(self, block_size: int, device: torch.device | str, *, sliding_window: int | None = None):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"expected block_size >= 1, got {block_size!r}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"expected sliding_window >= 1 or None, got {sliding_window}")
        self.block_size = block_size
        self.device = torch.device(device)
        self.sliding_window = sliding_window

    @property
    def metadata_cls(self) -> type[AttentionMetadata]:
        return AttentionMetadata if self.backend is None else self.backend.get_metadata_cls()

    def set_layers(self, impls: Iterable) -> None:
        """The attention impls (`AttentionImpl`) of the model whose steps this builder builds.

        Optional: backends that plan per layer setting ahead of the step (FlashInfer) plan these
        layers in `build`; the others only check them.
        """
        layers_of(self.backend, impls)

    def build(self, seqs: Sequence[ScheduledSeq], *, cuda_graph_pad_to: int | None = None) -> AttentionMetadata:
        self._validate(seqs, cuda_graph_pad_to)
        bs = self.block_size
        num_prefills = sum(s.is_prefill for s in seqs)
        seq_lens, context_lens, query_lens, tables, slots = [], [], [], [], []
        for s in seqs:
            slots += _slots(s.block_table, s.context_len, s.seq_len, bs)
            drop = self._dropped_blocks(s)
            seq_lens.append(s.seq_len - drop * bs)
            context_lens.append(s.context_len - drop * bs)
            query_lens.append(s.query_len)
            tables.append(list(s.block_table[drop:]))
        real_decode_lens = seq_lens[num_prefills:]
        if cuda_graph_pad_to is not None:
            pad = cuda_graph_pad_to - len(seqs)
            seq_lens += [1] * pad
            context_lens += [0] * pad
            query_lens += [1] * pad
            tables += [[]] * pad
            slots += [PAD_SLOT_ID] * pad

        enc = self._encoder_fields(seqs, num_prefills, pad_to=len(seq_lens))
        md = self._metadata(num_prefills, seq_lens, context_lens, query_lens, tables, slots, enc,
                            max_decode_seq_len=max(real_decode_lens, default=0),
                            use_cuda_graph=cuda_graph_pad_to is not None, slots_all_real=cuda_graph_pad_to is None,
                            fresh_prefills=all(s.context_len == 0 for s in seqs[:num_prefills]))
        self._extend(md, seqs)
        return md

    def build_shared_prefix(self, num_query_tokens: int, prefix_blocks: Sequence[int]) -> AttentionMetadata:
        """The metadata of a cascade's shared part: every one of the step's `num_query_tokens`
        query tokens (laid out as `build` lays them out) attends the keys of `prefix_blocks`,
        whole blocks that every sequence of the step holds first in its table, all of them
        before its first query. One query batch over those keys, read as cross-attention
        (an `ENCODER_DECODER` impl's `forward(query, None, None, ...)`: not causal, nothing
        written); each sequence's own keys are a `build` over its table without those blocks
        (`seq_len` less their tokens; slots do not change), and the two parts merge by their
        LSEs (`pagedattn.merge_attn_states`). Its fields: one prefill of `num_query_tokens`
        queries with no block of its own, `encoder_seq_lens` `[len(prefix_blocks) * block_size]`
        and `cross_block_tables` `[1, len(prefix_blocks)]`, marked `is_shared_prefix` (impls other
        than cross-attention refuse it).
        """
        if self.sliding_window is not None:
            raise ValueError(f"expected a builder without a sliding window for a shared prefix (read whole), got "
                             f"sliding_window={self.sliding_window}")
        try:
            t = None if isinstance(num_query_tokens, bool) else operator.index(num_query_tokens)
        except TypeError:
            t = None
        if t is None or t < 1:
            raise ValueError(f"expected num_query_tokens an int >= 1, got {num_query_tokens!r}")
        if isinstance(prefix_blocks, (str, bytes)) or not isinstance(prefix_blocks, Iterable):
            raise TypeError(f"expected prefix_blocks a sequence of block ids, got {type(prefix_blocks).__name__}")
        # host values: a tensor's elements would be 0-dim tensors (a bool one passing as an index)
        blocks = prefix_blocks.tolist() if isinstance(prefix_blocks, torch.Tensor) else list(prefix_blocks)
        if not blocks:
            raise ValueError("expected at least one prefix block, got none")
        _check_block_ids(None, "shared prefix block", blocks)
        blocks = [operator.index(b) for b in blocks]  # Python ints (NumPy's are ids too)
        prefix_len = len(blocks) * self.block_size
        enc = dict(num_tokens=0, lens=[prefix_len], start=[0, prefix_len], cross_slots=[], cross_width=len(blocks),
                   cross_rows_flat=blocks, max_block_id=max(blocks))
        md = self._metadata(1, [t], [0], [t], [[]], [PAD_SLOT_ID] * t, enc, max_decode_seq_len=0,
                            use_cuda_graph=False, slots_all_real=False, fresh_prefills=True)
        md.is_shared_prefix = True
        self._extend_shared_prefix(md)
        return md

    def _metadata(self, num_prefills: int, seq_lens: list[int], context_lens: list[int], query_lens: list[int],
                  tables: list[list[int]], slots: list[int], enc: dict | None, *, max_decode_seq_len: int,
                  use_cuda_graph: bool, slots_all_real: bool, fresh_prefills: bool) -> AttentionMetadata:
        """The metadata of a step's host lists (graph padding included), one copy per dtype to the device."""
        bs = self.block_size
        max_block_id = max((max(t) for t in tables if t), default=0)
        num_prefill_tokens = sum(query_lens[:num_prefills])
        num_decode_tokens = len(seq_lens) - num_prefills
        num_seqs = len(seq_lens)
        query_start = cumsum(query_lens)
        seq_start = cumsum(seq_lens)
        # The decode part's start locations, re-based to 0 (for `decode_metadata`).
        mixed = 0 < num_prefills < num_seqs
        dq = [x - query_start[num_prefills] for x in query_start[num_prefills:]] if mixed else []
        ds = [x - seq_start[num_prefills] for x in seq_start[num_prefills:]] if mixed else []
        width = max((len(t) for t in tables), default=0)
        rows = [t + [0] * (width - len(t)) for t in tables]

        int32_parts = [seq_lens, context_lens, query_start, seq_start, dq, ds, [x for r in rows for x in r]]
        int64_parts = [slots]
        if enc:
            int32_parts += [enc["lens"], enc["start"], enc["cross_rows_flat"]]
            int64_parts += [enc["cross_slots"]]
        i32 = self._to_device(int32_parts, torch.int32)
        i64 = self._to_device(int64_parts, torch.int64)

        md = self.metadata_cls(
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=num_decode_tokens,
            block_size=bs,
            slot_mapping=i64[0],
            seq_lens=seq_lens,
            query_lens=query_lens,
            seq_lens_tensor=i32[0],
            context_lens_tensor=i32[1],
            query_start_loc=i32[2],
            seq_start_loc=i32[3],
            block_tables=i32[6].view(num_seqs, width),
            max_query_len=max(query_lens, default=0),
            max_prefill_seq_len=max(seq_lens[:num_prefills], default=0),
            max_decode_seq_len=max_decode_seq_len,
            use_cuda_graph=use_cuda_graph,
            decode_query_start_loc=i32[4] if mixed else None,
            decode_seq_start_loc=i32[5] if mixed else None,
            slots_all_real=slots_all_real,
            max_block_id=max_block_id,
            fresh_prefills=fresh_prefills,
        )
        if enc:
            md.num_encoder_tokens = enc["num_tokens"]
            md.encoder_seq_lens = enc["lens"]
            md.encoder_seq_lens_tensor = i32[7]
            md.encoder_seq_start_loc = i32[8]
            md.max_encoder_seq_len = max(enc["lens"], default=0)
            md.cross_block_tables = i32[9].view(num_seqs, enc["cross_width"])
            md.cross_slot_mapping = i64[1]
            md.max_cross_block_id = enc["max_block_id"]
        return md

    def _extend(self, md: AttentionMetadata, seqs: Sequence[ScheduledSeq]) -> None:
        """Hook for backends that add fields (their plan inputs) to the metadata."""

    def _extend_shared_prefix(self, md: AttentionMetadata) -> None:
        """Hook for backends that add fields to a shared prefix's metadata (`build_shared_prefix`)."""

    def _dropped_blocks(self, s: ScheduledSeq) -> int:
        """Leading blocks wholly outside the window of the step's first query (position context_len)."""
        return window_start_block(s.context_len, self.sliding_window, self.block_size)

    def _validate(self, seqs: Sequence[ScheduledSeq], pad_to: int | None) -> None:
        seen_decode = False
        for i, s in enumerate(seqs):
            if not isinstance(s, ScheduledSeq):
                raise TypeError(f"expected ScheduledSeq at index {i}, got {type(s).__name__}")
            if s.is_prefill and seen_decode:
                raise ValueError(f"prefills must be listed before decodes, got a prefill at index {i} after a decode")
            seen_decode |= not s.is_prefill
            need = cdiv(s.seq_len, self.block_size)
            if len(s.block_table) < need:
                raise ValueError(
                    f"sequence {i}: block table too short, expected >= {need} blocks for seq_len={s.seq_len} "
                    f"(block_size={self.block_size}), got {len(s.block_table)}"
                )
            # Blocks the window dropped are never read: an engine may have freed them.
            _check_block_ids(i, "block", s.block_table[self._dropped_blocks(s):])
            _check_block_ids(i, "cross block", s.cross_block_table)
            if s.cross_block_table and len(s.cross_block_table) < cdiv(s.encoder_len, self.block_size):
                raise ValueError(
                    f"sequence {i}: cross block table too short, expected >= {cdiv(s.encoder_len, self.block_size)} "
                    f"blocks for encoder_len={s.encoder_len}, got {len(s.cross_block_table)}"
                )
        if pad_to is not None:
            if any(s.is_prefill for s in seqs):
                raise ValueError("cuda_graph_pad_to needs a decode-only batch, got prefills")
            if pad_to < len(seqs):
                raise ValueError(f"expected cuda_graph_pad_to >= {len(seqs)} sequences, got {pad_to}")

    def _encoder_fields(self, seqs: Sequence[ScheduledSeq], num_prefills: int, pad_to: int) -> dict | None:
        if not any(s.encoder_len or s.cross_block_table for s in seqs):
            return None
        lens = [s.encoder_len for s in seqs] + [0] * (pad_to - len(seqs))
        prefill_lens = lens[:num_prefills]
        cross_slots: list[int] = []
        for s in seqs[:num_prefills]:
            if s.cross_block_table:
                cross_slots += _slots(s.cross_block_table, 0, s.encoder_len, self.block_size)
            else:
                cross_slots += [PAD_SLOT_ID] * s.encoder_len
        cross = [list(s.cross_block_table) for s in seqs] + [[]] * (pad_to - len(seqs))
        width = max((len(t) for t in cross), default=0)
        return dict(
            num_tokens=sum(prefill_lens),
            lens=lens,
            start=cumsum(prefill_lens),
            cross_slots=cross_slots,
            cross_width=width,
            cross_rows_flat=[x for t in cross for x in t + [0] * (width - len(t))],
            max_block_id=max((max(t) for t in cross if t), default=0),
        )

    def _to_device(self, parts: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
        """One host tensor, one (pinned, non-blocking) copy, then views per part. Every view starts
        16 bytes aligned: Triton specialises a kernel on its pointers' alignment, so views at
        offsets that follow the batch's sizes would compile new variants as batches change."""
        align = max(1, _VIEW_ALIGN_BYTES // dtype.itemsize)
        padded = [len(p) + (-len(p)) % align for p in parts]
        values: list[int] = []
        for p, n in zip(parts, padded):
            values += p
            values += [0] * (n - len(p))
        flat = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        elif self.device != flat.device:
            flat = flat.to(self.device)
        offsets = [0, *itertools.accumulate(padded)]
        return [flat.narrow(0, start, len(p)) for start, p in zip(offsets, parts)]

