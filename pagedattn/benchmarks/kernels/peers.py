"""Peers on the same data: FlashInfer's wrappers called directly, and torch SDPA on dense copies.

flashinfer-raw: the wrappers FlashInfer's users call, planned once outside the timing, `run` on
the same K and V pools as our kernels (`(cache[0], cache[1])`, NHD pages). A paged step first
stores its K/V as the contract does: `flashinfer.append_paged_kv_cache` for bf16 caches; for FP8
caches our `store_kv`, because FlashInfer's append writes the inputs' dtype and takes no scale.
Decode-only steps run `BatchDecodeWithPagedKVCacheWrapper` (tensor cores by the `flashinfer`
backend's rule; `use_cuda_graph=True` with fixed page buffers when graph-timed, as FlashInfer
requires for capture); steps with prefills run `BatchPrefillWithPagedKVCacheWrapper` on them
(causal, bottom-right aligned) and the decode wrapper on the decodes: two calls for a mixed
step. Ragged steps run `BatchPrefillWithRaggedKVCacheWrapper`.

sdpa-cudnn / sdpa-flash: `torch.nn.functional.scaled_dot_product_attention` under
`sdpa_kernel(CUDNN_ATTENTION)` / `sdpa_kernel(FLASH_ATTENTION)` on contiguous [B, H, S, D]
copies: a dense upper bound, for steps that are dense-shaped (all sequences alike, bf16, no
window, soft cap or ALiBi; prefills with no cached prefix, since SDPA's causal mask is top-left
aligned; decodes). Prefill K/V are expanded to Hq heads (compute-bound: the same FLOPs); decode
uses `enable_gqa=True`.
"""

from __future__ import annotations

import importlib
from functools import cache

import torch
import torch.nn.functional as F

from pagedattn.attention.types import AttentionType
from pagedattn.backends.flashinfer_plan import LayerSpec
from pagedattn.intmath import cdiv
from pagedattn.kernels import store_kv

from .step import NotApplicable, Step
from .workload import DTYPE, FP8_SCALE, Workload

FLASHINFER_WORKSPACE_BYTES = 256 << 20


@cache
def flashinfer_missing() -> str | None:
    """Why FlashInfer cannot run here (None: it imports)."""
    try:
        importlib.import_module("flashinfer")
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to report
        return f"flashinfer does not import: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def _pages(w: Workload, rows: range) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indptr [n+1] int32 host, indices [pages] int32 device, last_page_len [n] int32 host) of
    sequences `rows`, in FlashInfer's CSR form."""
    bs, lens = w.case.block_size, w.case.seq_lens
    counts = [len(w.tables[b]) for b in rows]
    indptr = torch.zeros(len(counts) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(counts), 0)
    indices = torch.tensor([p for b in rows for p in w.tables[b]], dtype=torch.int32, device=w.device)
    last = torch.tensor([lens[b] - (cdiv(lens[b], bs) - 1) * bs for b in rows], dtype=torch.int32)
    return indptr, indices, last


def _decode_wrapper(fi, w: Workload, rows: range, buffer, graph: bool, common: dict):
    spec = LayerSpec(w.case.num_heads, w.case.num_kv_heads, w.case.head_size, w.scale,
                     common["window_left"], common["logits_soft_cap"] or 0.0, AttentionType.DECODER,
                     DTYPE, w.kv_dtype)
    indptr, indices, last = _pages(w, rows)
    if graph:
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            buffer, "NHD", use_cuda_graph=True, use_tensor_cores=spec.use_tensor_cores,
            paged_kv_indptr_buffer=indptr.to(w.device), paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last.to(w.device))
    else:
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(buffer, "NHD", use_tensor_cores=spec.use_tensor_cores)
    c = w.case
    wrapper.plan(indptr, indices, last, c.num_heads, c.num_kv_heads, c.head_size, c.block_size, **common)
    # backend="auto" resolves at plan time (fa2, or cuDNN where its engines can run): say which
    chosen = getattr(wrapper, "resolved_backend", None)
    return wrapper, ("tensor cores" if spec.use_tensor_cores else "CUDA cores") + (f", {chosen}" if chosen else "")


def prepare_flashinfer(w: Workload, graph: bool) -> Step:
    missing = flashinfer_missing()
    if missing:
        raise NotApplicable(missing)
    import flashinfer as fi

    c = w.case
    if c.alibi:
        raise NotApplicable("FlashInfer's batch wrappers take no per-head ALiBi slopes")
    buffer = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=w.device)
    common = dict(sm_scale=w.scale, window_left=c.sliding_window - 1 if c.sliding_window else -1,
                  logits_soft_cap=c.soft_cap, q_data_type=DTYPE, kv_data_type=w.kv_dtype)
    run_kw = dict(k_scale=FP8_SCALE, v_scale=FP8_SCALE) if c.fp8 else {}
    qo_host = w.query_start_loc.cpu()
    keep: list = [buffer]

    if not c.paged:
        wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(buffer, "NHD")
        wrapper.plan(qo_host, qo_host, c.num_heads, c.num_kv_heads, c.head_size, causal=True, **common)
        keep.append(wrapper)
        calls = [lambda s=s: wrapper.run(s.query, s.key, s.value, out=s.out) for s in w.sets]
        return Step(calls, lambda: w.sets[0].out, store="-", note="ragged prefill wrapper", keep=keep)

    p, t = c.num_prefills, c.num_tokens
    t_pre = int(qo_host[p])
    parts, notes = [], []  # (wrapper, first token, end token)
    if p:
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(buffer, "NHD")
        indptr, indices, last = _pages(w, range(p))
        wrapper.plan(qo_host[: p + 1], indptr, indices, last, c.num_heads, c.num_kv_heads, c.head_size,
                     c.block_size, causal=True, **common)
        parts.append((wrapper, 0, t_pre))
        notes.append("paged prefill wrapper (backend auto)")
    if p < c.num_seqs:  # the float workspace is shared: runs are stream-ordered (each wrapper
        # keeps its plan in its own int workspace)
        wrapper, cores = _decode_wrapper(fi, w, range(p, c.num_seqs), buffer, graph, common)
        parts.append((wrapper, t_pre, t))
        notes.append(f"decode wrapper ({cores}{', use_cuda_graph' if graph else ''})")
    keep += [x[0] for x in parts]

    if c.fp8:
        store = "store_kv (FlashInfer's append takes no FP8 scale)"

        def put(s):
            store_kv(s.key, s.value, s.cache[0], s.cache[1], w.slot_mapping, w.k_scale, w.v_scale)
    else:
        store = "append_paged_kv_cache"
        indptr, indices, last = (x.to(w.device) for x in _pages(w, range(c.num_seqs)))
        batch_idx, positions = fi.get_batch_indices_positions(w.query_start_loc, w.seq_lens, t)
        keep += [indptr, indices, last, batch_idx, positions]

        def put(s):
            fi.append_paged_kv_cache(s.key, s.value, batch_idx, positions, (s.cache[0], s.cache[1]),
                                     indices, indptr, last)

    def call(s) -> None:
        put(s)
        kv = (s.cache[0], s.cache[1])
        for wrapper, a, b in parts:
            wrapper.run(s.query[a:b], kv, out=s.out[a:b], **run_kw)

    return Step([lambda s=s: call(s) for s in w.sets], lambda: w.sets[0].out, store=store,
                note=" + ".join(notes), keep=keep)


SDPA_KINDS = ("cudnn", "flash")


def sdpa_refusal(w: Workload) -> str | None:
    """Why dense SDPA does not stand for this case (None: it does)."""
    c = w.case
    if not c.uniform:
        return "sequences differ in length: no dense equivalent"
    if c.fp8:
        return "dense SDPA takes no FP8 K/V"
    if c.features:
        return f"dense SDPA has no {c.features}"
    ctx, q_len = c.seqs[0]
    if q_len > 1 and ctx > 0:
        return "SDPA's causal mask is top-left aligned: no chunk over a cached prefix"
    return None


def prepare_sdpa(kind: str, w: Workload) -> Step:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    why = sdpa_refusal(w)
    if why:
        raise NotApplicable(why)
    c = w.case
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[kind]
    causal = c.max_query_len > 1
    group = c.num_heads // c.num_kv_heads
    dense = []
    for i in range(len(w.sets)):
        q, k, v = w.dense(i)
        if causal and group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        dense.append((q, k, v))
    result: dict[str, torch.Tensor] = {}

    def call(i: int) -> None:
        q, k, v = dense[i]
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=w.scale,
                                               enable_gqa=not causal and group > 1)
        if i == 0:
            result["out"] = o

    def output() -> torch.Tensor:
        return result["out"].transpose(1, 2).reshape(c.num_tokens, c.num_heads, c.head_size)

    note = "dense [B, H, S, D]; " + ("K/V expanded to Hq heads" if causal and group > 1 else "enable_gqa")
    return Step([lambda i=i: call(i) for i in range(len(dense))], output, store="-", note=note, keep=[dense])
