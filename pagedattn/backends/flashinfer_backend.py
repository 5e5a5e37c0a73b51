"""The `flashinfer` backend: FlashInfer 0.7's paged prefill/decode wrappers over the
`(num_blocks, 2, block_size, Hkv, D)` cache ("NHD" pages: K = kv[:, 0], V = kv[:, 1]).

Plan once per step, run per layer:
- A layer's `LayerSpec` (scale, window, soft cap, head counts, dtypes: what FlashInfer fixes at
  plan time) is known once the layer knows its query dtype (`set_query_dtype`, which the model
  loader and `pagedattn.Attention(dtype=)` call). Gemma 2's alternating windows are two specs.
- The layers to plan come from whoever owns the model: `builder.set_layers(impls)` and
  `state.set_layers(impls)` (the engine's runner calls both). `FlashInferMetadataBuilder.build`
  computes each part's pages (`PagedKV`) and plans one wrapper per (part, spec): the prefill view
  on `BatchPrefillWithPagedKVCacheWrapper` (causal: bottom-right aligned, so chunked prefill and
  prefix-cache hits take the same path), the decode view on `BatchDecodeWithPagedKVCacheWrapper`
  (tensor cores for grouped heads). Graph-padded metadata is planned by
  `FlashInferState.begin_forward` instead.
- `FlashInferImpl._attend` picks its planned wrapper and runs it: no planning, no host sync, no
  allocation. Only a layer nobody gave to `set_layers` (code using the contract alone), or one
  never told its dtype, is planned on its first forward (outside CUDA-graph capture); its spec
  is then remembered by the builder, which plans it in every later step.

FP8 caches take real scales. FlashInfer's `run(k_scale=, v_scale=)` wants Python floats
(k_scale is folded into the host-side sm_scale, exactly, in float32): the layer's `KVScales`
reads a tensor scale to the host once per in-place change, so steps do not synchronise. A CUDA
graph keeps the value it was captured with. Only a tensor first met inside a capture is applied
on the device: q * k_scale written into `out` and run from there (rounding q * k_scale to the
model dtype costs some precision), out *= v_scale.

The LSE (`forward(..., return_lse=True)`): the wrappers' `run(lse=, return_lse=True)` write
FlashInfer's base-2 LSE ([T, Hq], log2 of the softmax denominator) into the caller's rows, then
scaled by ln 2 in place.

Refused at construction: ALiBi (FlashInfer's ALIBI mode uses its own fixed slopes, `run()`
takes no per-head slopes), float32 (FlashInfer compiles no fp32 kernels), head sizes FlashInfer
does not build (see `FlashInferBackend.capabilities`), attention sinks and windows of
bidirectional attention (the reasons are in `capabilities`).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from pagedattn.attention.backend import AttentionBackend, Capabilities
from pagedattn.attention.builder import MetadataBuilder
from pagedattn.attention.impl import AttendCall, AttentionImpl, Source, layers_of
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.state import AttentionState
from pagedattn.attention.types import AttentionType
from pagedattn.dtypes import kv_cache_dtype
from pagedattn.backends.flashinfer_plan import (LayerSpec, PagedKV, Plans, Role,
                                                host_int32, make_wrapper, pages_on_device,
                                                pages_on_host, workspace)
from pagedattn.intmath import cumsum

_MIN_VERSION = (0, 7)
_LN2 = 0.6931471805599453


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("flashinfer-python", "flashinfer"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def unavailable_reasons() -> list[str]:
    """Why this backend cannot run here; imports neither flashinfer nor a CUDA context."""
    reasons = []
    if importlib.util.find_spec("flashinfer") is None:
        reasons.append("needs the flashinfer package (pip install flashinfer-python)")
    else:
        v = _version()
        parts = tuple(int(x) for x in re.findall(r"\d+", v or "")[:2])
        if v is not None and parts < _MIN_VERSION:
            reasons.append(f"needs flashinfer >= {'.'.join(map(str, _MIN_VERSION))}, found {v}")
    if not torch.cuda.is_available():
        reasons.append("needs a CUDA GPU")
    return reasons


class FlashInferBackend(AttentionBackend):
    # Head sizes: those FlashInfer's kernels are tested with. Its JIT also instantiates other
    # multiples of 16, but on an H100 the paged prefill with head size 80 (FA2 template,
    # FlashInfer 0.7.2) faulted with an illegal memory access, so we refuse them.
    capabilities = Capabilities(
        head_sizes=(64, 128, 256),
        dtypes=(torch.float16, torch.bfloat16),
        alibi=False,
        why_not=(("alibi", "FlashInfer 0.7's batch wrappers apply their own fixed slopes "
                           "(pos_encoding_mode='ALIBI') and take no per-head slopes"),
                 # FlashInfer 0.7.2's paged prefill/decode `run(sinks=)` reaches only its trtllm-gen
                 # (Blackwell) kernels; the FA2/FA3 kernels it runs on sm_80-sm_90 are called without it
                 # (prefill.py, `paged_run`), and its sink variant is a separately JIT-built module
                 ("sinks", "FlashInfer 0.7.2's paged wrappers apply `sinks=` on its Blackwell trtllm-gen kernels "
                           "only; its FA2/FA3 kernels (sm_80-sm_90) ignore it"),
                 ("two_sided_window", "FlashInfer's window_left bounds a causal window on the left only")),
    )
    kv_cache_block_dim = 0  # swap/copy move whole kv[blk] slices (K and V of the block)

    @staticmethod
    def get_name() -> str:
        return "flashinfer"

    @classmethod
    def provider(cls) -> str:
        v = _version()
        return f"flashinfer {v}" if v else "flashinfer"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlashInferImpl

    @staticmethod
    def get_metadata_cls() -> type[AttentionMetadata]:
        return FlashInferMetadata

    @staticmethod
    def get_builder_cls() -> type[MetadataBuilder]:
        return FlashInferMetadataBuilder

    @staticmethod
    def get_state_cls() -> type[AttentionState]:
        return FlashInferState

    @staticmethod
    def kv_cache_layout(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_cache[:, 0], kv_cache[:, 1]


class PlannedLayers:
    """The layers a builder (or a graph state) plans each step: the model's, given through
    `set_layers`, plus the specs of layers met unplanned in a forward (contract-only use)."""

    def __init__(self) -> None:
        self.impls: list[FlashInferImpl] = []
        self.met: set[LayerSpec] = set()

    def set_layers(self, impls: Iterable[AttentionImpl]) -> None:
        self.impls = layers_of(FlashInferBackend, impls)

    def specs(self) -> set[LayerSpec]:
        """Distinct specs of the layers whose query dtype is known, and those met since."""
        return {impl.spec(d) for impl in self.impls for d in impl.q_dtypes} | self.met


# ----------------------------------------------------------------------------- metadata


@dataclass
class FlashInferMetadata(AttentionMetadata):
    """The common metadata plus FlashInfer's pages of the part it describes.

    `paged_kv` / `cross_paged_kv` (through `cross_block_tables`) describe this metadata's
    sequences; a mixed batch's top level has none (its prefill/decode views do). `plans` holds
    the wrappers planned for this part, per (role, spec); `layers` is what its builder plans.
    """

    paged_kv: PagedKV | None = field(default=None, repr=False, compare=False)
    cross_paged_kv: PagedKV | None = field(default=None, repr=False, compare=False)
    plans: Plans | None = field(default=None, repr=False, compare=False)
    layers: PlannedLayers | None = field(default=None, repr=False, compare=False)

    @property
    def paged_kv_indptr(self) -> torch.Tensor | None:  # int32 [B+1]
        return None if self.paged_kv is None else self.paged_kv.indptr

    @property
    def paged_kv_indices(self) -> torch.Tensor | None:  # int32 [B*W+1], valid prefix indptr[-1]
        return None if self.paged_kv is None else self.paged_kv.indices

    @property
    def paged_kv_last_page_len(self) -> torch.Tensor | None:  # int32 [B], 1..block_size
        return None if self.paged_kv is None else self.paged_kv.last_page_len

    def _slice(self, prefill: bool) -> AttentionMetadata:
        view = super()._slice(prefill)
        _attach(view)
        return view

    def advance_step(self, input_tokens, input_positions, sampled_token_ids, block_size, num_seqs, num_queries) -> None:
        """The common advance (tokens, positions, lengths, slots), then this batch's pages on
        the device (indptr, indices, last-page lengths, no host sync) and their host copies,
        and a re-plan of the decode wrappers this metadata holds (host work only)."""
        super().advance_step(input_tokens, input_positions, sampled_token_ids, block_size, num_seqs, num_queries)
        kv = self.paged_kv
        pages_on_device(self.block_tables, self.seq_lens_tensor, block_size,
                        out=(kv.indptr, kv.indices, kv.last_page_len))
        indptr, last = pages_on_host(self.seq_lens, block_size)
        # fresh pinned tensors: an async copy of the old ones may still be in flight
        kv.indptr_host, kv.last_page_len_host = host_int32(indptr), host_int32(last)
        self.plans.replan_all(lambda role: kv if role is Role.DECODE else None, block_size)


def _paged(block_tables, seq_lens_tensor, seq_lens: list[int], query_lens: list[int], block_size: int) -> PagedKV:
    indptr, last = pages_on_host(seq_lens, block_size)
    return PagedKV(*pages_on_device(block_tables, seq_lens_tensor, block_size),
                   indptr_host=host_int32(indptr), last_page_len_host=host_int32(last),
                   qo_indptr_host=host_int32(cumsum(query_lens)))


def _attach(md: FlashInferMetadata) -> None:
    """Give `md` its pages (when it is one part: all prefills or all decodes) and a `Plans`."""
    md.plans = Plans(md.slot_mapping.device)
    md.paged_kv = md.cross_paged_kv = None
    if md.num_prefills and md.num_decode_tokens:
        return
    bs = md.block_size
    md.paged_kv = _paged(md.block_tables, md.seq_lens_tensor, md.seq_lens, md.query_lens, bs)
    if md.cross_block_tables is not None and md.encoder_seq_lens is not None:
        md.cross_paged_kv = _paged(md.cross_block_tables, md.encoder_seq_lens_tensor,
                                   md.encoder_seq_lens, md.query_lens, bs)


# ----------------------------------------------------------------------------- planning


def _ragged_inputs(md: FlashInferMetadata, spec: LayerSpec):
    """(qo_indptr, kv_indptr) host tensors of the ragged roles, or None when absent."""
    kind, p = spec.attn_type, md.num_prefills
    if kind is AttentionType.ENCODER:
        if md.encoder_seq_lens is None:
            return None
        enc = host_int32(cumsum(md.encoder_seq_lens[:p]))
        return enc, enc
    if kind is AttentionType.ENCODER_DECODER:  # profiling: prefills over their encoder tokens
        if md.encoder_seq_lens is None:
            return None
        return host_int32(cumsum(md.query_lens[:p])), host_int32(cumsum(md.encoder_seq_lens[:p]))
    qo = host_int32(cumsum(md.query_lens))  # ENCODER_ONLY, or a DECODER's profiling run
    return qo, qo


def _inputs(part: FlashInferMetadata, role: Role, spec: LayerSpec):
    if role in (Role.PREFILL, Role.DECODE):
        return part.paged_kv
    if role in (Role.CROSS_PREFILL, Role.CROSS_DECODE):
        return part.cross_paged_kv
    return _ragged_inputs(part, spec)


def _ensure_plan(part: FlashInferMetadata, role: Role, spec: LayerSpec):
    """The wrapper planned for (role, spec) on this part, planning it if missing (None when
    the part lacks what the role reads, e.g. cross tables)."""
    wrapper = part.plans.get(role, spec)
    if wrapper is None:
        inputs = _inputs(part, role, spec)
        if inputs is not None:
            wrapper = part.plans.plan(role, spec, inputs, part.block_size)
    return wrapper


def _role(source: Source, prefill_part: bool, attn_type: AttentionType) -> Role:
    """The wrapper kind that runs a call: paged prefill/decode over the cache or the cross
    tables, or ragged over the step's rows (causal only for a DECODER's profiling run)."""
    if source is Source.STEP:
        return Role.RAGGED_CAUSAL if attn_type is AttentionType.DECODER else Role.RAGGED
    if source is Source.CROSS_CACHE:
        return Role.CROSS_PREFILL if prefill_part else Role.CROSS_DECODE
    return Role.PREFILL if prefill_part else Role.DECODE


def _part_roles(md: FlashInferMetadata, spec: LayerSpec):
    """(part, role) pairs a layer of `spec` runs on for this step (cache present)."""
    if spec.attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
        return [(md, Role.RAGGED)]
    source = Source.CROSS_CACHE if spec.attn_type is AttentionType.ENCODER_DECODER else Source.CACHE
    return [(part, _role(source, part is md.prefill_metadata, spec.attn_type))
            for part in (md.prefill_metadata, md.decode_metadata) if part is not None]


def plan_step(md: FlashInferMetadata, specs: set[LayerSpec], decoder_only: bool = False) -> None:
    """Plan `specs` for this step (specs already planned are kept); `decoder_only` for
    CUDA-graph capture metadata, which captures decoder decodes only."""
    for spec in specs:
        if decoder_only and spec.attn_type is not AttentionType.DECODER:
            continue
        if spec.attn_type is AttentionType.ENCODER and not md.num_encoder_tokens:
            continue
        for part, role in _part_roles(md, spec):
            _ensure_plan(part, role, spec)


class FlashInferMetadataBuilder(MetadataBuilder):
    """The common builder, then FlashInfer's pages per part and the step's plans for the
    layers given to `set_layers`."""

    backend = FlashInferBackend

    def __init__(self, block_size: int, device, *, sliding_window: int | None = None):
        super().__init__(block_size, device, sliding_window=sliding_window)
        if self.device.type != "cuda":
            raise ValueError(f"the 'flashinfer' backend needs a CUDA device, got {self.device}")
        self.layers = PlannedLayers()

    def set_layers(self, impls: Iterable[AttentionImpl]) -> None:
        self.layers.set_layers(impls)

    def _extend(self, md: FlashInferMetadata, seqs) -> None:
        md.layers = self.layers
        _attach(md)
        _ = (md.prefill_metadata, md.decode_metadata)  # the views (and their pages) are built here
        if not md.use_cuda_graph:  # graph-padded steps are planned by FlashInferState.begin_forward
            plan_step(md, self.layers.specs())

    def _extend_shared_prefix(self, md: FlashInferMetadata) -> None:
        """A shared prefix's pages: its cross tables only (its one query batch has no block of its
        own), planned for the cross-attention layers among the given ones (the prefix impls)."""
        md.layers = self.layers
        md.plans = Plans(md.slot_mapping.device)
        md.paged_kv = None
        md.cross_paged_kv = _paged(md.cross_block_tables, md.encoder_seq_lens_tensor, md.encoder_seq_lens,
                                   md.query_lens, md.block_size)
        plan_step(md, {s for s in self.layers.specs() if s.attn_type is AttentionType.ENCODER_DECODER})


# ----------------------------------------------------------------------------- CUDA graphs


class FlashInferState(AttentionState):
    """CUDA-graph decode: per captured batch size, one `use_cuda_graph=True` decode wrapper per
    spec over fixed page buffers (indptr [max_bs+1], indices [max_bs*max_blocks+1], last-page
    lengths [max_bs], shared by all specs and sizes). `begin_forward` re-plans them for the real
    lengths before each replay; `prepare_graph_input_buffers` copies the pages with the rest."""

    backend = FlashInferBackend
    _PAGED = ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")
    # A shared prefix runs on a prefill wrapper planned per step on the host (its buffers made by
    # each plan); the graph wrappers here are decode ones. Cascade steps run eagerly.
    shared_prefix_graphs = False

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, block_size: int, device):
        super().__init__(max_batch_size, max_blocks_per_seq, block_size, device)
        self._graph_plans: dict[int, Plans] = {}  # batch size -> its graph wrappers (shared by clones)
        self.layers = PlannedLayers()

    def set_layers(self, impls: Iterable[AttentionImpl]) -> None:
        self.layers.set_layers(impls)

    def _allocate(self) -> dict[str, torch.Tensor]:
        n, w, dev = self.max_batch_size, self.max_blocks_per_seq, self.device
        buffers = super()._allocate()
        buffers["paged_kv_indptr"] = torch.arange(n + 1, dtype=torch.int32, device=dev)
        buffers["paged_kv_indices"] = torch.zeros(n * w + 1, dtype=torch.int32, device=dev)
        buffers["paged_kv_last_page_len"] = torch.ones(n, dtype=torch.int32, device=dev)
        return buffers

    def _extend_capture_metadata(self, md: FlashInferMetadata) -> None:
        n, b = md.num_seqs, self._buffers
        out = (b["paged_kv_indptr"][: n + 1], b["paged_kv_indices"], b["paged_kv_last_page_len"][:n])
        indptr, last = pages_on_host(md.seq_lens, self.block_size)
        md.paged_kv = PagedKV(*pages_on_device(md.block_tables, md.seq_lens_tensor, self.block_size, out=out),
                              indptr_host=host_int32(indptr), last_page_len_host=host_int32(last),
                              qo_indptr_host=host_int32(cumsum(md.query_lens)))
        if n not in self._graph_plans:
            self._graph_plans[n] = Plans(self.device, lambda role, spec: self._graph_wrapper(n, role, spec))
        md.plans = self._graph_plans[n]
        md.layers = self.layers
        plan_step(md, self.layers.specs(), decoder_only=True)

    def _graph_wrapper(self, n: int, role: Role, spec: LayerSpec):
        if role is not Role.DECODE:
            raise NotImplementedError(
                f"the 'flashinfer' backend captures decoder self-attention decode only, got {role.value} "
                f"({spec.attn_type.name})")
        ws = workspace(self.device)
        ws.ensure(spec, graph_batch_size=n)
        b = self._buffers
        return make_wrapper(role, spec, ws.buffer, graph_buffers=dict(
            indptr=b["paged_kv_indptr"][: n + 1], indices=b["paged_kv_indices"],
            last_page_len=b["paged_kv_last_page_len"][:n]))

    def get_graph_input_buffers(self, attn_metadata: FlashInferMetadata) -> dict[str, torch.Tensor]:
        buffers = super().get_graph_input_buffers(attn_metadata)
        for name in self._PAGED:
            buffers[name] = getattr(attn_metadata, name)
        return buffers

    def prepare_graph_input_buffers(self, input_buffers: dict[str, torch.Tensor], attn_metadata: FlashInferMetadata) -> None:
        super().prepare_graph_input_buffers(input_buffers, attn_metadata)
        for name in self._PAGED:
            src = getattr(attn_metadata, name)
            input_buffers[name][: src.shape[0]].copy_(src, non_blocking=True)

    def begin_forward(self, attn_metadata: FlashInferMetadata) -> None:
        """Re-plan the graph wrappers of this batch size for the real lengths (before replay), or
        plan the metadata's own wrappers when no graph of its size was captured."""
        md = attn_metadata
        graph = self._graph_plans.get(md.num_seqs) if md.use_cuda_graph else None
        if graph is None:
            plan_step(md, (md.layers or self.layers).specs())
        else:
            graph.replan_all(lambda role: md.paged_kv if role is Role.DECODE else None, self.block_size)

    def graph_clone(self, batch_size: int) -> FlashInferState:
        clone = super().graph_clone(batch_size)
        clone._graph_plans = self._graph_plans
        clone.layers = self.layers
        return clone


# ----------------------------------------------------------------------------- impl


class FlashInferImpl(AttentionImpl):
    backend = FlashInferBackend
    split_parts = True  # prefill and decode parts run on different wrappers

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.q_dtypes: set[torch.dtype] = set()  # query dtypes declared or seen; a step plans each
        self._specs: dict[torch.dtype, LayerSpec] = {}

    def set_query_dtype(self, dtype: torch.dtype) -> None:
        """From the next `build` on, every step plans this layer for `dtype` queries."""
        super().set_query_dtype(dtype)
        self.q_dtypes.add(dtype)

    def spec(self, q_dtype: torch.dtype) -> LayerSpec:
        if q_dtype not in self._specs:
            self._specs[q_dtype] = self._make_spec(q_dtype)
        return self._specs[q_dtype]

    def _make_spec(self, q_dtype: torch.dtype) -> LayerSpec:
        no_cache = self.attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)
        return LayerSpec(
            num_qo_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_size,
            sm_scale=self.scale,
            window_left=-1 if self.window is None else self.window[0],  # a DECODER's: (left, 0)
            logits_soft_cap=float(self.logits_soft_cap or 0.0), attn_type=self.attn_type, q_dtype=q_dtype,
            kv_dtype=q_dtype if no_cache else kv_cache_dtype(self.kv_cache_dtype, q_dtype))

    def _attend(self, q, out, call: AttendCall, kv_cache, scales, lse=None) -> None:
        """q/out: [Tc, Hq, D] fp16/bf16; kv_cache: (num_blocks, 2, bs, Hkv, D), or None for a
        call over the step's own K/V (`call.k`/`call.v` [Tk, Hkv, D]); lse: [Tc, Hq] float32."""
        part = call.md
        if not isinstance(part, FlashInferMetadata) or part.plans is None:
            raise TypeError(f"expected metadata from the flashinfer builder or state, got {type(part).__name__}")
        self.q_dtypes.add(q.dtype)
        spec = self.spec(q.dtype)
        wrapper = _wrapper(part, _role(call.source, call.is_prefill_part, self.attn_type), spec)
        lse_args = {} if lse is None else dict(lse=lse, return_lse=True)
        if call.source is Source.STEP:
            wrapper.run(q, call.k, call.v, out=out, **lse_args)
        elif scales is None:
            wrapper.run(q, kv_cache, out=out, **lse_args)
        else:
            self._run_fp8(wrapper, q, kv_cache, out, scales, lse_args)
        if lse is not None:
            lse.mul_(_LN2)  # FlashInfer's LSE is base 2

    def _run_fp8(self, wrapper, q, kv_cache, out, scales, lse_args) -> None:
        ks, vs = scales.host()
        run_scales = {}
        if ks is None:  # in a capture, a scale tensor never read: apply it on the device
            torch.mul(q, scales.k, out=out)  # s = sm_scale * (q * k_scale) . k_stored
            q = out
        else:
            run_scales["k_scale"] = ks
        if vs is not None:
            run_scales["v_scale"] = vs
        wrapper.run(q, kv_cache, out=out, **run_scales, **lse_args)
        if vs is None:
            out.mul_(scales.v)


def _wrapper(part: FlashInferMetadata, role: Role, spec: LayerSpec):
    """The wrapper planned for (role, spec). A layer the step did not plan (not given to
    `set_layers`, or its dtype not known then) is planned now, outside CUDA-graph capture only,
    and its spec remembered, so later steps plan it in `build`."""
    wrapper = part.plans.get(role, spec)
    if wrapper is not None:
        return wrapper
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"flashinfer: no {role.value} plan for {spec} in this CUDA-graph capture; give the model's "
            "layers to state.set_layers(...), or run the layer once eagerly (warm-up) before capturing")
    wrapper = _ensure_plan(part, role, spec)
    if wrapper is None:
        raise ValueError(
            f"{spec.attn_type.name} attention needs "
            f"{'cross_block_tables and encoder lengths' if spec.attn_type is AttentionType.ENCODER_DECODER else 'encoder lengths'}"
            ": build with ScheduledSeq(encoder_len=..., cross_block_table=...)")
    if part.layers is not None:
        part.layers.met.add(spec)
    return wrapper
