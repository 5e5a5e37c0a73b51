"""The common metadata builder: host-side work of a step, then one copy of each dtype to the device.

Every block id of a step's tables goes to the device (256 sequences of 1k tokens: 16k ids), so
they are converted, checked and padded in bulk (`HostInts`, then one `aminmax`); Python loops run
per sequence, and per block only over a prefill's new tokens. A bad id found in bulk is then named
by the per-id check (`_validate(..., block_ids=True)`), so errors read as they always did.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from pagedattn.attention.host_ints import HostInts
from pagedattn.attention.impl import layers_of
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.types import PAD_SLOT_ID, ScheduledSeq, window_start_block
from pagedattn.intmath import cdiv, cumsum

_BLOCK_ID_END = 2**31  # block ids are int32 in the tables (DESIGN.md, "KV cache")


def _check_block_ids(i: int | None, what: str, ids: Sequence) -> None:
    """Each of `ids` an int in [0, 2**31) (tables are int32), not a bool (`operator.index` takes
    True as block 1); else a ValueError naming sequence `i` (None: no sequence) and the bad id.
    `build` runs it only once its bulk check (`HostInts`, in C) has failed: that check takes a
    bool for 0 or 1, which a check per id in Python would catch at 0.65 ms per 16k ids (measured
    on the CPU, 2026-11-27), as much again as the whole bulk conversion."""
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
    """Slots of positions [start, stop) of a sequence with this block table (a run per block)."""
    out: list[int] = []
    for i in range(start // block_size, cdiv(stop, block_size)):
        first = block_table[i] * block_size
        out += range(first + max(start - i * block_size, 0), first + min(stop - i * block_size, block_size))
    return out


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
        try:
            num_prefills = self._validate(seqs, cuda_graph_pad_to, block_ids=False)
            md = self._build(seqs, num_prefills, cuda_graph_pad_to)
        except (TypeError, ValueError):
            # The first error in the sequences' order, naming a bad block id (the bulk check cannot)
            self._validate(seqs, cuda_graph_pad_to, block_ids=True)
            raise
        self._extend(md, seqs)
        return md

    def _build(self, seqs: Sequence[ScheduledSeq], num_prefills: int, pad_to: int | None) -> AttentionMetadata:
        bs = self.block_size
        seq_lens = [s.seq_len for s in seqs]
        query_lens = [s.query_len for s in seqs]
        context_lens = [n - q for n, q in zip(seq_lens, query_lens)]
        tables = [s.block_table for s in seqs]
        if self.sliding_window is not None:
            drops = [self._dropped_blocks(s) for s in seqs]
            tables = [t[d:] for t, d in zip(tables, drops)]
            seq_lens = [n - d * bs for n, d in zip(seq_lens, drops)]
            context_lens = [c - d * bs for c, d in zip(context_lens, drops)]
        real_decode_lens = seq_lens[num_prefills:]
        pad = 0 if pad_to is None else pad_to - len(seqs)
        if pad:
            seq_lens += [1] * pad
            context_lens += [0] * pad
            query_lens += [1] * pad
            tables += [()] * pad
        enc = self._encoder_fields(seqs, num_prefills, pad_to=len(seq_lens))
        return self._metadata(num_prefills, seq_lens, context_lens, query_lens, tables, enc, num_real=len(seqs),
                              max_decode_seq_len=max(real_decode_lens, default=0), use_cuda_graph=pad_to is not None,
                              slots_all_real=pad_to is None,
                              fresh_prefills=all(s.context_len == 0 for s in seqs[:num_prefills]))

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
        enc = _Encoder(num_tokens=0, lens=[prefix_len], start=[0, prefix_len], tables=[blocks], written=0)
        md = self._metadata(1, [t], [0], [t], [()], enc, num_real=0, max_decode_seq_len=0,
                            use_cuda_graph=False, slots_all_real=False, fresh_prefills=True)
        md.is_shared_prefix = True
        self._extend_shared_prefix(md)
        return md

    def _metadata(self, num_prefills: int, seq_lens: list[int], context_lens: list[int], query_lens: list[int],
                  tables: list[Sequence[int]], enc: _Encoder | None, *, num_real: int,
                  max_decode_seq_len: int, use_cuda_graph: bool, slots_all_real: bool,
                  fresh_prefills: bool) -> AttentionMetadata:
        """The metadata of a step's host lists (graph padding included), one copy per dtype to the
        device. The first `num_real` rows are sequences whose query tokens have slots in their
        tables; the others' tokens write nothing. Raises ValueError for a block id that is not an
        int in [0, 2**31) (`_validate(..., block_ids=True)` then names it)."""
        bs = self.block_size
        num_prefill_tokens = sum(query_lens[:num_prefills])
        num_decode_tokens = len(seq_lens) - num_prefills
        num_seqs = len(seq_lens)
        query_start = cumsum(query_lens)
        seq_start = cumsum(seq_lens)
        # The decode part's start locations, re-based to 0 (for `decode_metadata`).
        mixed = 0 < num_prefills < num_seqs
        dq = [x - query_start[num_prefills] for x in query_start[num_prefills:]] if mixed else []
        ds = [x - seq_start[num_prefills] for x in seq_start[num_prefills:]] if mixed else []
        width = max(map(len, tables), default=0)

        i32 = HostInts(torch.int32)
        for part in (seq_lens, context_lens, query_start, seq_start, dq, ds):
            i32.add(part)
        rows = i32.add_rows(tables, width)
        if enc:
            i32.add(enc.lens)
            i32.add(enc.start)
            cross_width = max(map(len, enc.tables), default=0)
            cross_rows = i32.add_rows(enc.tables, cross_width)
        max_block_id = _max_id(i32.host(rows))
        max_cross_block_id = _max_id(i32.host(cross_rows)) if enc else 0

        # every block id is an int in [0, 2**31) from here: the slots are too
        slots = []
        for t, c, n in zip(tables[:num_real], context_lens, seq_lens):
            if n - c == 1:  # a decode's one token
                slots.append(t[c // bs] * bs + c % bs)
            else:
                slots += _slots(t, c, n, bs)
        slots += [PAD_SLOT_ID] * sum(query_lens[num_real:])
        i64 = HostInts(torch.int64)
        i64.add(slots)
        if enc:
            cross_slots = []
            for t, n in zip(enc.tables[:enc.written], enc.lens):
                cross_slots += _slots(t, 0, n, bs) if t else [PAD_SLOT_ID] * n
            i64.add(cross_slots)
        i32_dev, i64_dev = i32.to(self.device), i64.to(self.device)

        md = self.metadata_cls(
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=num_decode_tokens,
            block_size=bs,
            slot_mapping=i64_dev[0],
            seq_lens=seq_lens,
            query_lens=query_lens,
            seq_lens_tensor=i32_dev[0],
            context_lens_tensor=i32_dev[1],
            query_start_loc=i32_dev[2],
            seq_start_loc=i32_dev[3],
            block_tables=i32_dev[rows].view(num_seqs, width),
            max_query_len=max(query_lens, default=0),
            max_prefill_seq_len=max(seq_lens[:num_prefills], default=0),
            max_decode_seq_len=max_decode_seq_len,
            use_cuda_graph=use_cuda_graph,
            decode_query_start_loc=i32_dev[4] if mixed else None,
            decode_seq_start_loc=i32_dev[5] if mixed else None,
            slots_all_real=slots_all_real,
            max_block_id=max_block_id,
            fresh_prefills=fresh_prefills,
        )
        if enc:
            md.num_encoder_tokens = enc.num_tokens
            md.encoder_seq_lens = enc.lens
            md.encoder_seq_lens_tensor = i32_dev[rows + 1]
            md.encoder_seq_start_loc = i32_dev[rows + 2]
            md.max_encoder_seq_len = max(enc.lens, default=0)
            md.cross_block_tables = i32_dev[cross_rows].view(num_seqs, cross_width)
            md.cross_slot_mapping = i64_dev[1]
            md.max_cross_block_id = max_cross_block_id
        return md

    def _extend(self, md: AttentionMetadata, seqs: Sequence[ScheduledSeq]) -> None:
        """Hook for backends that add fields (their plan inputs) to the metadata."""

    def _extend_shared_prefix(self, md: AttentionMetadata) -> None:
        """Hook for backends that add fields to a shared prefix's metadata (`build_shared_prefix`)."""

    def _dropped_blocks(self, s: ScheduledSeq) -> int:
        """Leading blocks wholly outside the window of the step's first query (position context_len)."""
        return window_start_block(s.context_len, self.sliding_window, self.block_size)

    def _validate(self, seqs: Sequence[ScheduledSeq], pad_to: int | None, *, block_ids: bool) -> int:
        """Check the step (its block ids too with `block_ids`: `_metadata` checks them in bulk, and
        this names the first bad one when that check fails); returns the number of prefills."""
        seen_decode = False
        num_prefills = 0
        bs = self.block_size
        for i, s in enumerate(seqs):
            if not isinstance(s, ScheduledSeq):
                raise TypeError(f"expected ScheduledSeq at index {i}, got {type(s).__name__}")
            prefill = s.is_prefill
            if prefill and seen_decode:
                raise ValueError(f"prefills must be listed before decodes, got a prefill at index {i} after a decode")
            num_prefills += prefill
            seen_decode |= not prefill
            need = cdiv(s.seq_len, bs)
            if len(s.block_table) < need:
                raise ValueError(
                    f"sequence {i}: block table too short, expected >= {need} blocks for seq_len={s.seq_len} "
                    f"(block_size={bs}), got {len(s.block_table)}"
                )
            if block_ids:
                # Blocks the window dropped are never read: an engine may have freed them.
                _check_block_ids(i, "block", s.block_table[self._dropped_blocks(s):])
                _check_block_ids(i, "cross block", s.cross_block_table)
            if s.cross_block_table and len(s.cross_block_table) < cdiv(s.encoder_len, bs):
                raise ValueError(
                    f"sequence {i}: cross block table too short, expected >= {cdiv(s.encoder_len, bs)} "
                    f"blocks for encoder_len={s.encoder_len}, got {len(s.cross_block_table)}"
                )
        if pad_to is not None:
            if num_prefills:
                raise ValueError("cuda_graph_pad_to needs a decode-only batch, got prefills")
            if pad_to < len(seqs):
                raise ValueError(f"expected cuda_graph_pad_to >= {len(seqs)} sequences, got {pad_to}")
        return num_prefills

    def _encoder_fields(self, seqs: Sequence[ScheduledSeq], num_prefills: int, pad_to: int) -> _Encoder | None:
        if not any(s.encoder_len or s.cross_block_table for s in seqs):
            return None
        lens = [s.encoder_len for s in seqs] + [0] * (pad_to - len(seqs))
        return _Encoder(num_tokens=sum(lens[:num_prefills]), lens=lens, start=cumsum(lens[:num_prefills]),
                        tables=[s.cross_block_table for s in seqs] + [()] * (pad_to - len(seqs)),
                        written=num_prefills)


@dataclass
class _Encoder:
    """A step's encoder fields as host lists: the encoder tokens of its first `written` rows (its
    prefills) are written through their cross tables (a row without one writes nothing)."""

    num_tokens: int
    lens: list[int]
    start: list[int]
    tables: list[Sequence[int]]
    written: int


def _max_id(ids: torch.Tensor) -> int:
    """The largest of these host block ids (0 for none); ValueError for a negative one."""
    if not ids.numel():
        return 0
    lo, hi = (int(x) for x in torch.aminmax(ids))
    if lo < 0:
        raise ValueError(f"expected block ids >= 0, got {lo}")
    return hi
