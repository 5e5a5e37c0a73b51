"""`AttentionImpl`: one layer's attention, and the one `forward` every backend shares.

`forward` is a template (API.md section 3):
1. check the inputs against the layer and the step (shapes, dtypes, the cache's layout, and the
   step's largest block id against the cache's pool: host ints, no synchronisation);
2. take the step's FP8 scales (`KVScales`, one per layer);
3. resolve where each query attends (`AttendCall`s: the cache through the step's block tables,
   the cache through the cross tables, or the step's own K/V rows);
4. store the step's K/V once, at `slot_mapping` (DECODER) or `cross_slot_mapping`
   (ENCODER_DECODER), through `_store` on the K/V halves `Backend.split_kv_cache` gives, viewed
   as [num_blocks, block_size, Hkv, D]; or, where the backend says so (`_stores_in_attend`:
   a step of one call that writes the rows before it reads them), in that call
   (`AttendCall.store_slots`);
5. call the backend's `_attend` for each, with the rows of the caller's LSE buffer when
   `forward(..., return_lse=True)` asked for the softmax's log-sum-exp.
A backend implements `_attend` (and `_store` when it has its own store kernel); backends that
run the prefill and decode parts of a step separately set `split_parts`.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass

import torch

from pagedattn.attention.kv_scales import KVScales, Scale
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.types import AttentionType
from pagedattn.device_profile import DeviceProfile
from pagedattn.dtypes import FP8_DTYPES, KV_CACHE_DTYPE_NAMES, kv_cache_dtype
from pagedattn.kv_cache import store_kv


class Source(enum.Enum):
    """Where an `AttendCall`'s keys and values come from."""

    CACHE = "cache"  # the sequences' blocks: block_tables, seq_lens (DECODER)
    CROSS_CACHE = "cross_cache"  # the encoder's blocks: cross_block_tables, encoder lengths (ENCODER_DECODER)
    STEP = "step"  # the step's own K/V rows (encoders; profiling runs with an empty cache)


@dataclass(slots=True)
class AttendCall:
    """The queries `q[rows]` of the sequences of `md` over one source of keys/values.

    Sequence b's queries are rows `query_start_loc[b]..query_start_loc[b+1]` of `q[rows]`; it
    has `kv_lens[b]` keys: through `block_tables[b]` in the cache views `k`/`v`
    (`[num_blocks, block_size, Hkv, D]`), or, for `Source.STEP`, rows
    `kv_start_loc[b]..` of the step's `k`/`v` (`[Tk, Hkv, D]`). Causal calls are bottom-right
    aligned (a query at row i of a sequence of q_len queries and kv_len keys is at position
    kv_len - q_len + i).
    """

    md: AttentionMetadata  # the whole step, or its prefill or decode view
    rows: slice
    source: Source
    causal: bool
    query_start_loc: torch.Tensor  # int32 [B+1]
    max_query_len: int
    kv_lens: torch.Tensor  # int32 [B]
    kv_lens_host: list[int]  # host [B], as `kv_lens` (a CUDA graph's are those it was captured with)
    max_kv_len: int
    block_tables: torch.Tensor | None  # int32 [B, W] (cache sources)
    kv_start_loc: torch.Tensor | None  # int32 [B+1] (Source.STEP)
    k: torch.Tensor
    v: torch.Tensor
    step_k: torch.Tensor | None = None  # [Tc, Hkv, D] the step's own K/V rows of these queries
    step_v: torch.Tensor | None = None  # (Source.CACHE calls; a fresh prompt's keys are exactly these)
    store_slots: torch.Tensor | None = None  # the call also writes step_k/step_v into k/v at these slots

    @property
    def is_prefill_part(self) -> bool:
        return self.md.num_prefills > 0

    @property
    def keys_are_step_rows(self) -> bool:
        """A cache call of fresh prompts only (no cached prefix, no decode): its keys and values
        are exactly the step's own rows `step_k`/`step_v`, which a backend may read instead of
        the cache (contiguous, in the model dtype: an FP8 cache's rounding not applied)."""
        md = self.md
        return (self.source is Source.CACHE and self.step_k is not None and md.fresh_prefills
                and md.num_prefills > 0 and md.num_decode_tokens == 0)


class AttentionImpl:
    """One layer's attention. Construction validates every option against the backend's
    `Capabilities`; `forward` writes the step's K/V into the cache, then attends.

    Subclasses set `backend` and implement `_attend`.
    """

    backend: type  # the AttentionBackend
    split_parts: bool = False  # attend a mixed step's prefill and decode parts in separate calls

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | torch.Tensor | None = None,
        sliding_window: int | tuple[int, int] | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: AttentionType = AttentionType.DECODER,
        sinks: torch.Tensor | None = None,
    ):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(
                f"expected num_heads to be a positive multiple of num_kv_heads, got {num_heads} and {num_kv_heads}"
            )
        if head_size < 1:
            raise ValueError(f"expected head_size >= 1, got {head_size}")
        if not isinstance(attn_type, AttentionType):
            raise ValueError(f"expected attn_type to be a pagedattn.AttentionType, got {attn_type!r}")
        if kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(f"expected kv_cache_dtype in {list(KV_CACHE_DTYPE_NAMES)}, got {kv_cache_dtype!r}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"expected logits_soft_cap > 0 or None, got {logits_soft_cap}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.alibi_slopes = _slopes(alibi_slopes, num_heads)
        # FlashAttention's window_size (left, right): keys in [p - left, p + right], -1 unbounded
        self.window = _window(sliding_window, attn_type)
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap
        self.attn_type = attn_type
        self.sinks = _sinks(sinks, num_heads)
        self.kv_scales = KVScales()
        self._alibi_on: dict[torch.device, torch.Tensor] = {}
        self._sinks_copy: torch.Tensor | None = None
        # (a weak reference to the cache, what was checked): `_check_kv_cache`; weak, so that a pool
        # the caller drops is freed
        self._checked_cache: tuple | None = None
        self._check_semantics()
        # what the backend can run on this process's device (the current CUDA device, else the CPU)
        self._check_capabilities(self.backend.capabilities_on(DeviceProfile.of()))

    def _check_semantics(self) -> None:
        if self.attn_type is AttentionType.ENCODER_DECODER and self.alibi_slopes is not None:
            raise ValueError("ALiBi is not defined for cross-attention (ENCODER_DECODER): positions do not compare")

    def _check_capabilities(self, caps) -> None:
        name = self.backend.get_name()
        refusals = []
        if caps.head_sizes and self.head_size not in caps.head_sizes:
            refusals.append(f"head_size={self.head_size} (supported: {list(caps.head_sizes)})")
        if self.kv_cache_dtype not in caps.kv_cache_dtypes:
            why = dict(caps.why_not).get("kv_cache_dtype")
            refusals.append(f"kv_cache_dtype={self.kv_cache_dtype!r} (supported: {list(caps.kv_cache_dtypes)}"
                            f"{'; ' + why if why else ''})")
        if self.attn_type not in caps.attn_types:
            refusals.append(f"attn_type={self.attn_type.name} (supported: {[t.name for t in caps.attn_types]})")
        if self.alibi_slopes is not None and not caps.alibi:
            refusals.append(f"alibi_slopes{caps.reason('alibi')}")
        if self.window is not None and not caps.sliding_window:
            refusals.append(f"sliding_window{caps.reason('sliding_window')}")
        elif self.window is not None and self.attn_type in _BIDIRECTIONAL and not caps.two_sided_window:
            refusals.append(f"sliding_window={self.window} on {self.attn_type.name} attention"
                            f"{caps.reason('two_sided_window')}")
        if self.logits_soft_cap is not None and not caps.logits_soft_cap:
            refusals.append(f"logits_soft_cap{caps.reason('logits_soft_cap')}")
        if self.sinks is not None and not caps.sinks:
            refusals.append(f"sinks{caps.reason('sinks')}")
        if refusals:
            raise NotImplementedError(f"the {name!r} backend does not support: {', '.join(refusals)}")

    def set_query_dtype(self, dtype: torch.dtype) -> None:
        """Declare the dtype of the queries `forward` will get (the model's dtype).

        Optional. Backends that plan ahead (FlashInfer plans its kernels in `build`) plan this
        layer from the next step on. Refuses a dtype the backend cannot run, as `forward` would.
        """
        dtypes = self.backend.capabilities.dtypes
        if dtype not in dtypes:
            raise TypeError(f"the {self.backend.get_name()!r} backend expects a query dtype in {list(dtypes)}, got {dtype}")

    # ------------------------------------------------------------------ forward (the template)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        k_scale: Scale = 1.0,
        v_scale: Scale = 1.0,
        output: torch.Tensor | None = None,
        *,
        return_lse: bool = False,
        output_lse: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Write `key`/`value` into `kv_cache` at the step's slots, then attend.

        Args:
            query: [T, Hq*D] or [T, Hq, D] in fp32/fp16/bf16.
            key, value: [Tk, Hkv*D] or [Tk, Hkv, D] in the query's dtype; None only for
                cross-attention reading the cache. Tk is T, or the encoder tokens for
                ENCODER and ENCODER_DECODER.
            kv_cache: one layer's cache of `get_kv_cache_shape(...)`, or numel 0 (profiling).
            k_scale, v_scale: FP8 scales, floats or 0-dim float32 tensors.
            output: [T, Hq*D] in the query's dtype; written in place and returned.
            return_lse: also return the softmax's log-sum-exp (for merging attention over
                disjoint keys: `pagedattn.merge_attn_states`).
            output_lse: [T, Hq] float32, contiguous; the LSE is written there (no allocation).
        Returns:
            [T, Hq*D]; with `return_lse`, (out, lse): lse float32 [T, Hq], the natural log of
            each query row's softmax denominator (its sink's term included), -inf for a row
            that sees no key and has no sink.
        """
        md = attn_metadata
        q, k, v = self._check_inputs(query, key, value, kv_cache, md)
        out = self._check_output(output, q)
        o = out.view(q.shape)
        lse = self._check_lse(output_lse, q) if return_lse or output_lse is not None else None
        cached = kv_cache.numel() > 0 and self.attn_type in (AttentionType.DECODER, AttentionType.ENCODER_DECODER)
        k_cache = v_cache = None
        scales = None
        if cached:
            if kv_cache.dtype in FP8_DTYPES:
                scales = self.kv_scales.update(k_scale, v_scale, kv_cache.device)
            k_cache, v_cache = self._cache_views(kv_cache, md.block_size)
        slots = None
        if cached and k is not None:
            slots = md.slot_mapping if self.attn_type is AttentionType.DECODER else md.cross_slot_mapping
        calls = self._calls(q, k, v, k_cache, v_cache, md, slots)
        if slots is not None and calls[0].store_slots is None:
            self._store(k, v, k_cache, v_cache, slots, scales, md, self.attn_type is AttentionType.ENCODER_DECODER)
        for call in calls:
            if call.rows.start != call.rows.stop:
                self._attend(q[call.rows], o[call.rows], call, kv_cache if cached else None, scales,
                             None if lse is None else lse[call.rows])
        return out if lse is None else (out, lse)

    def _cache_views(self, kv_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V halves of `kv_cache` (`Backend.split_kv_cache`), each viewed as [num_blocks,
        block_size, Hkv, D]: a layout that flattens a block's slots (xformers) cannot name Hkv
        and D itself, the layer can. (Not kept between calls: a view holds its pool alive.)"""
        k_cache, v_cache = self.backend.split_kv_cache(kv_cache)
        shape = (k_cache.shape[0], block_size, self.num_kv_heads, self.head_size)
        return k_cache.view(shape), v_cache.view(shape)

    def _store(self, k, v, k_cache, v_cache, slots: torch.Tensor, scales: KVScales | None,
               md: AttentionMetadata, cross: bool) -> None:
        """Write k/v [Tk, Hkv, D] at `slots` int64 [Tk] (-1: nowhere) of the cache views
        [num_blocks, block_size, Hkv, D]. The PyTorch store, with its plan kept for the step."""
        plan = md.cross_store_plan() if cross else md.store_plan()
        ks, vs = (scales.k, scales.v) if scales is not None else (1.0, 1.0)
        store_kv(k, v, k_cache, v_cache, slots, ks, vs, plan)

    def _stores_in_attend(self, calls: list[AttendCall]) -> bool:
        """Whether `_attend` writes the step's K/V itself, in the one call of `calls` (with
        `store_slots` set), before anything reads them: no other call reads the cache before
        the store. False here: `_store` runs first."""
        return False

    def _attend(self, q: torch.Tensor, out: torch.Tensor, call: AttendCall, kv_cache: torch.Tensor | None,
                scales: KVScales | None, lse: torch.Tensor | None = None) -> None:
        """Attend `q` [Tc, Hq, D] as `call` says, into `out` [Tc, Hq, D]. `kv_cache` is the
        layer's whole cache (None when the call reads the step's rows or the cache is empty);
        `scales` the FP8 scales (None unless the cache is FP8); `lse` [Tc, Hq] float32, where
        given, receives each row's natural-log LSE (`forward`'s)."""
        raise NotImplementedError

    def sinks_on(self, device: torch.device) -> torch.Tensor | None:
        """The attention sinks [Hq] on `device`: the tensor given (a model's parameter, read at
        every call, so weights loaded into it in place take effect), or a copy made once where
        it lives on another device; None without sinks."""
        if self.sinks is None or self.sinks.device == device:
            return self.sinks
        if self._sinks_copy is None or self._sinks_copy.device != device:
            self._sinks_copy = self.sinks.to(device)
        return self._sinks_copy

    def alibi_slopes_on(self, device: torch.device) -> torch.Tensor | None:
        """The ALiBi slopes float32 [Hq] on `device` (copied once), or None."""
        if self.alibi_slopes is None:
            return None
        if device not in self._alibi_on:
            self._alibi_on[device] = self.alibi_slopes.to(device)
        return self._alibi_on[device]

    # ------------------------------------------------------------------ sources

    def _calls(self, q, k, v, k_cache, v_cache, md: AttentionMetadata,
               slots: torch.Tensor | None = None) -> list[AttendCall]:
        """The step's calls; with `slots` (the step's K/V to store there), the one call of a step
        that writes them itself (`_stores_in_attend`) carries them as `store_slots`."""
        calls = self._sources(q, k, v, k_cache, v_cache, md)
        if slots is not None and self._stores_in_attend(calls):
            calls[0].store_slots = slots
        return calls

    def _sources(self, q, k, v, k_cache, v_cache, md: AttentionMetadata) -> list[AttendCall]:
        kind, every = self.attn_type, slice(0, q.shape[0])
        if kind is AttentionType.ENCODER_ONLY:
            loc = md.query_start_loc
            return [AttendCall(md, every, Source.STEP, False, loc, md.max_query_len, _lengths(loc), md.query_lens,
                               md.max_query_len, None, loc, k, v)]
        if kind is AttentionType.ENCODER:
            loc = md.encoder_seq_start_loc
            p = md.num_prefills
            return [AttendCall(md, every, Source.STEP, False, loc, md.max_encoder_seq_len, md.encoder_seq_lens_tensor[:p],
                               md.encoder_seq_lens[:p], md.max_encoder_seq_len, None, loc, k, v)]
        if k_cache is None:  # profiling with an empty cache: attend over the step's own K/V
            if kind is AttentionType.DECODER:
                loc = md.query_start_loc
                return [AttendCall(md, every, Source.STEP, True, loc, md.max_query_len, _lengths(loc), md.query_lens,
                                   md.max_query_len, None, loc, k, v)]
            if md.num_decode_tokens:
                raise ValueError("cross-attention decode needs the encoder K/V in the cache, got an empty kv_cache")
            p = md.num_prefills
            return [AttendCall(md, every, Source.STEP, False, md.query_start_loc, md.max_query_len,
                               md.encoder_seq_lens_tensor[:p], md.encoder_seq_lens[:p], md.max_encoder_seq_len,
                               None, md.encoder_seq_start_loc, k, v)]
        cross = kind is AttentionType.ENCODER_DECODER
        if cross and md.cross_block_tables is None:
            raise ValueError("ENCODER_DECODER attention over the cache needs cross block tables: "
                             "build with ScheduledSeq(encoder_len=..., cross_block_table=...)")
        if not (self.split_parts and md.num_prefills and md.num_decode_tokens):
            return [self._cache_call(md, every, md.max_query_len, cross, k_cache, v_cache, k, v)]
        p = md.num_prefill_tokens
        return [self._cache_call(md.prefill_metadata, slice(0, p), md.max_query_len, cross, k_cache, v_cache, k, v),
                self._cache_call(md.decode_metadata, slice(p, q.shape[0]), 1, cross, k_cache, v_cache, k, v)]

    @staticmethod
    def _cache_call(part: AttentionMetadata, rows: slice, max_query_len: int, cross: bool, k_cache, v_cache,
                    k, v) -> AttendCall:
        if cross:
            return AttendCall(part, rows, Source.CROSS_CACHE, False, part.query_start_loc, max_query_len,
                              part.encoder_seq_lens_tensor, part.encoder_seq_lens, part.max_encoder_seq_len,
                              part.cross_block_tables, None, k_cache, v_cache)
        max_kv = max(part.max_prefill_seq_len, part.max_decode_seq_len)
        return AttendCall(part, rows, Source.CACHE, True, part.query_start_loc, max_query_len,
                          part.seq_lens_tensor, part.seq_lens, max_kv, part.block_tables, None, k_cache, v_cache,
                          None if k is None else k[rows], None if v is None else v[rows])

    # ------------------------------------------------------------------ checks

    def _query_tokens(self, md: AttentionMetadata) -> int:
        return md.num_encoder_tokens if self.attn_type is AttentionType.ENCODER else md.num_tokens

    def _kv_tokens(self, md: AttentionMetadata) -> int:
        return md.num_encoder_tokens if self.attn_type is AttentionType.ENCODER_DECODER else self._query_tokens(md)

    def _check_inputs(self, query, key, value, kv_cache, md):
        if not isinstance(md, AttentionMetadata):
            raise TypeError(f"expected AttentionMetadata, got {type(md).__name__}")
        if md.is_shared_prefix and self.attn_type is not AttentionType.ENCODER_DECODER:
            # its queries have no block of their own: a kernel would read past its empty block table
            raise ValueError(f"expected a step's metadata (`build`) for {self.attn_type.name} attention, got a "
                             "shared prefix's (`build_shared_prefix`), which only cross-attention reads: hand it "
                             "to the layers as forward_context(..., shared_prefix=)")
        dtypes = self.backend.capabilities.dtypes
        if query.dtype not in dtypes:
            raise TypeError(f"expected query dtype in {list(dtypes)}, got {query.dtype}")
        if self.attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_DECODER) and md.encoder_seq_lens is None:
            raise ValueError(f"{self.attn_type.name} attention needs encoder lengths: build with ScheduledSeq(encoder_len=...)")
        t = self._query_tokens(md)
        q = _heads_view("query", query, t, self.num_heads, self.head_size)
        if (key is None) != (value is None):
            raise ValueError("expected key and value both given or both None")
        if key is None:
            if self.attn_type is not AttentionType.ENCODER_DECODER:
                raise ValueError(f"key/value may be None only for ENCODER_DECODER, got attn_type={self.attn_type.name}")
            if kv_cache.numel() == 0:
                raise ValueError("cross-attention with key=None reads the cache, got an empty kv_cache")
            k = v = None
        else:
            tk = self._kv_tokens(md)
            k = _heads_view("key", key, tk, self.num_kv_heads, self.head_size)
            v = _heads_view("value", value, tk, self.num_kv_heads, self.head_size)
            for name, x in (("key", k), ("value", v)):
                if x.dtype != query.dtype or x.device != query.device:
                    raise TypeError(f"expected {name} {query.dtype} on {query.device}, got {x.dtype} on {x.device}")
        if kv_cache.numel() and self.attn_type in (AttentionType.DECODER, AttentionType.ENCODER_DECODER):
            self._check_kv_cache(kv_cache, query, md)
        return q, k, v

    def _check_kv_cache(self, kv_cache: torch.Tensor, query: torch.Tensor, md: AttentionMetadata) -> None:
        bd = self.backend.kv_cache_block_dim
        # The layout checks hold for as long as the layer gets the same cache and query dtype (every
        # step of an engine): checked once, then only the step's block ids against the pool.
        key = (kv_cache.shape, kv_cache.dtype, kv_cache.device, md.block_size, query.dtype, query.device)
        checked = self._checked_cache
        if checked is None or checked[0]() is not kv_cache or checked[1] != key:
            self._check_kv_layout(kv_cache, query, md)
            self._checked_cache = (weakref.ref(kv_cache), key)
        n = kv_cache.shape[bd] if kv_cache.dim() > bd else 0
        # Every block a kernel may read or write is named by the step's tables (slots included):
        # a host int per table, recorded by `build`, against the pool's size.
        if self.attn_type is AttentionType.DECODER:
            largest, what = md.max_block_id, "block_tables"
        else:
            largest, what = md.max_cross_block_id, "cross_block_tables"
        if largest >= n:
            raise IndexError(f"expected block ids in [0, {n}) (the kv_cache's pool), got block {largest} in {what}")

    def _check_kv_layout(self, kv_cache: torch.Tensor, query: torch.Tensor, md: AttentionMetadata) -> None:
        expected_dtype = kv_cache_dtype(self.kv_cache_dtype, query.dtype)
        if kv_cache.dtype != expected_dtype:
            raise TypeError(
                f"expected kv_cache dtype {expected_dtype} (kv_cache_dtype={self.kv_cache_dtype!r}, "
                f"query {query.dtype}), got {kv_cache.dtype}"
            )
        if kv_cache.device != query.device:
            raise ValueError(f"expected kv_cache on {query.device}, got {kv_cache.device}")
        bd = self.backend.kv_cache_block_dim
        n = kv_cache.shape[bd] if kv_cache.dim() > bd else 0
        expected = self.backend.get_kv_cache_shape(n, md.block_size, self.num_kv_heads, self.head_size)
        if tuple(kv_cache.shape) != tuple(expected):
            raise ValueError(
                f"expected kv_cache shape {tuple(expected)} (block_size={md.block_size}, Hkv={self.num_kv_heads}, "
                f"D={self.head_size}), got {tuple(kv_cache.shape)}"
            )

    def _check_lse(self, output_lse: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
        t = q.shape[0]
        if output_lse is None:
            return torch.empty(t, self.num_heads, dtype=torch.float32, device=q.device)
        if output_lse.dtype != torch.float32 or output_lse.device != q.device:
            raise TypeError(f"expected output_lse float32 on {q.device}, got {output_lse.dtype} on {output_lse.device}")
        if tuple(output_lse.shape) != (t, self.num_heads) or not output_lse.is_contiguous():
            raise ValueError(f"expected a contiguous output_lse of [{t}, {self.num_heads}], "
                             f"got {list(output_lse.shape)}")
        return output_lse

    def _check_output(self, output: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
        t = q.shape[0]
        if output is None:
            return q.new_empty(t, self.num_heads * self.head_size)
        if output.dtype != q.dtype or output.device != q.device:
            raise TypeError(f"expected output {q.dtype} on {q.device}, got {output.dtype} on {output.device}")
        if output.numel() != q.numel() or output.shape[0] != t or not output.is_contiguous():
            raise ValueError(
                f"expected a contiguous output of [{t}, {self.num_heads * self.head_size}], got {list(output.shape)}"
            )
        return output if output.dim() == 2 else output.view(t, self.num_heads * self.head_size)


def layers_of(backend, impls) -> list[AttentionImpl]:
    """`impls` as a list, each checked to be an `AttentionImpl` of `backend` (any backend when
    None): what `set_layers` of a builder or state accepts."""
    out = list(impls)
    for i, impl in enumerate(out):
        if not isinstance(impl, AttentionImpl) or (backend is not None and impl.backend is not backend):
            name = "an AttentionImpl" if backend is None else f"an impl of the {backend.get_name()!r} backend"
            raise TypeError(f"set_layers: expected {name} at index {i}, got {type(impl).__name__}")
    return out


def _lengths(start_loc: torch.Tensor) -> torch.Tensor:
    return start_loc[1:] - start_loc[:-1]


def _heads_view(name: str, x: torch.Tensor, tokens: int, heads: int, head_size: int) -> torch.Tensor:
    """View `x` as [tokens, heads, head_size], or raise saying what was expected."""
    ok_2d = x.dim() == 2 and tuple(x.shape) == (tokens, heads * head_size)
    ok_3d = x.dim() == 3 and tuple(x.shape) == (tokens, heads, head_size)
    if not (ok_2d or ok_3d):
        raise ValueError(
            f"expected {name} of shape [{tokens}, {heads * head_size}] or [{tokens}, {heads}, {head_size}] "
            f"(tokens from the metadata), got {list(x.shape)}"
        )
    if x.stride(-1) != 1:
        raise ValueError(f"expected {name} with a unit stride in its last dimension, got strides {x.stride()}")
    return x.view(tokens, heads, head_size) if ok_2d else x


def _sinks(sinks, num_heads: int) -> torch.Tensor | None:
    """`sinks` checked: a floating tensor [Hq] of unit stride (kernels index it by head), one
    logit per query head (gpt-oss's learnable sinks), kept as given (not copied)."""
    if sinks is None:
        return None
    if (not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or tuple(sinks.shape) != (num_heads,)
            or sinks.stride(0) != 1):
        got = (f"{sinks.dtype} {list(sinks.shape)} of stride {sinks.stride()}" if isinstance(sinks, torch.Tensor)
               else type(sinks).__name__)
        raise ValueError(f"expected sinks a floating-point tensor of [{num_heads}] (one logit per query head) "
                         f"of unit stride, got {got}")
    return sinks


_BIDIRECTIONAL = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)


def _window(sliding_window, attn_type: AttentionType) -> tuple[int, int] | None:
    """`sliding_window` as FlashAttention's `window_size` (left, right): the query at position p
    sees keys in [p - left, p + right], -1 unbounded on that side; None for no window.

    An int W (W >= 1) is W keys up to the query's own position: (W - 1, 0). A (left, right)
    tuple (ints >= -1) reaches past the query (right > 0) only where attention is bidirectional
    (ENCODER, ENCODER_ONLY); a DECODER's is causal, so its right side is 0 (or -1: the same
    mask). Cross-attention (ENCODER_DECODER) takes none: decoder and encoder positions do not
    compare. (-1, -1) is no window."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, int) and not isinstance(sliding_window, bool) and sliding_window >= 1:
        window = (sliding_window - 1, 0)
    elif (isinstance(sliding_window, (tuple, list)) and len(sliding_window) == 2
          and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in sliding_window)):
        window = tuple(sliding_window)
    else:
        raise ValueError("expected sliding_window an int >= 1, a (left, right) tuple of ints >= -1 "
                         f"(FlashAttention's window_size), or None, got {sliding_window!r}")
    if attn_type is AttentionType.ENCODER_DECODER:
        raise ValueError(f"sliding_window is not defined for cross-attention (ENCODER_DECODER): decoder and "
                         f"encoder positions do not compare, got {sliding_window!r}")
    if attn_type is AttentionType.DECODER:
        if window[1] not in (-1, 0):
            raise ValueError(f"a DECODER's sliding_window cannot reach past the query (causal attention): expected "
                             f"right in (-1, 0), got {sliding_window!r} (two-sided windows are for ENCODER and "
                             "ENCODER_ONLY attention)")
        window = (window[0], 0)
        return None if window[0] == -1 else window
    return None if window == (-1, -1) else window


def _slopes(alibi_slopes, num_heads: int) -> torch.Tensor | None:
    if alibi_slopes is None:
        return None
    slopes = torch.as_tensor(alibi_slopes, dtype=torch.float32)
    if slopes.shape != (num_heads,):
        raise ValueError(f"expected alibi_slopes of [{num_heads}] (one per query head), got {list(slopes.shape)}")
    return slopes
