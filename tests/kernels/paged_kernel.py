"""A paged batch (tests/paged_batch.py) as the arguments of `pagedattn.kernels.paged_attention`.

The kernels attend without storing, so the batch is built with the step's own K/V already in
the pool (`write_step=True`); the oracle reads the batch's dense copies, never the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import pagedattn
from oracle import dense_attention_with_lse
from paged_batch import Lens, PagedBatch, make_paged_batch

# A (2, num_blocks, block_size, Hkv, D) pool: K and V are the [num_blocks, block_size, Hkv, D]
# views the kernels take. The torch backend declares this layout and runs everywhere.
POOL_LAYOUT = pagedattn.get_backend("torch")


def kernel_batch(lens: Lens, *, num_heads: int, num_kv_heads: int, head_size: int,
                 block_size: int, dtype: torch.dtype, device, kv_cache_dtype: str = "auto",
                 seed: int = 0, spare_blocks: int = 3, **options) -> PagedBatch:
    """`make_paged_batch` over (context_len, query_len) per sequence, step K/V in the pool."""
    return make_paged_batch(POOL_LAYOUT, lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            head_size=head_size, block_size=block_size, dtype=dtype,
                            device=device, kv_cache_dtype=kv_cache_dtype, seed=seed,
                            spare_blocks=spare_blocks, write_step=True, **options)


@dataclass
class KernelArgs:
    """What `paged_attention` reads of a batch; tensors on the batch's device."""

    query: torch.Tensor            # [T, Hq, D] model dtype
    k_cache: torch.Tensor          # [num_blocks, block_size, Hkv, D] cache dtype (a view)
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor         # [B] int32
    block_tables: torch.Tensor     # [B, width] int32
    max_query_len: int
    max_seq_len: int


def kernel_args(batch: PagedBatch, table_width: int | None = None) -> KernelArgs:
    """The batch's pool, lengths and tables. Table entries past a sequence's blocks hold a
    spare block id: in range, but junk the kernel must not read."""
    need = [len(t) for t in batch.block_tables]
    width = max(max(need), table_width or 1)
    filler = batch.spare_blocks[-1] if batch.spare_blocks else 0
    rows = [t + [filler] * (width - len(t)) for t in batch.block_tables]
    dev = batch.device
    starts = [0]
    for _, q in batch.lens:
        starts.append(starts[-1] + q)
    return KernelArgs(
        query=batch.query,
        k_cache=batch.layout.kv(batch.kv_cache, 0), v_cache=batch.layout.kv(batch.kv_cache, 1),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32, device=dev),
        block_tables=torch.tensor(rows, dtype=torch.int32, device=dev),
        max_query_len=max(q for _, q in batch.lens), max_seq_len=max(batch.seq_lens))


def attend(args: KernelArgs, *, scale: float, lse: bool = True, **kernel_options):
    """One `paged_attention` call: (out [T, Hq, D], lse [T, Hq] float32 or None)."""
    from pagedattn.kernels import paged_attention

    out = torch.empty_like(args.query)
    # a value the kernel must overwrite
    lse_t = torch.full(args.query.shape[:2], 7.0, device=args.query.device) if lse else None
    paged_attention(args.query, args.k_cache, args.v_cache, out,
                    query_start_loc=args.query_start_loc, seq_lens=args.seq_lens,
                    block_tables=args.block_tables, max_query_len=args.max_query_len,
                    max_seq_len=args.max_seq_len, scale=scale, lse=lse_t, **kernel_options)
    return out, lse_t


def oracle_options(kernel_options: dict) -> dict:
    """The kernel's options under the oracle's names (the oracle has no launch parameters)."""
    names = {"soft_cap": "logits_soft_cap", "sliding_window": "sliding_window",
             "alibi_slopes": "alibi_slopes", "sinks": "sinks"}
    return {names[k]: v for k, v in kernel_options.items() if k in names}


def check_contiguous_kv(q_lens: list[int], kv_lens: list[int], *, num_heads: int, num_kv_heads: int, causal: bool,
                        dtype: torch.dtype, device, tol: float, seed: int, head_size: int = 48,
                        **kernel_options) -> tuple[torch.Tensor, list[int]]:
    """One `paged_attention` launch over contiguous K/V rows ([total_kv + 2, Hkv, D], sequence b's
    keys at `kv_start_loc[b]`, no block table; the encoder, cross-attention and profiling path),
    each sequence's output and LSE held to the dense oracle. Returns (lse [T, Hq], query starts)."""
    from pagedattn.kernels import paged_attention

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), num_heads, head_size, generator=g).to(dtype)
    k, v = (torch.randn(sum(kv_lens) + 2, num_kv_heads, head_size, generator=g).to(dtype) for _ in range(2))
    qsl = [sum(q_lens[:i]) for i in range(len(q_lens) + 1)]
    ksl = [sum(kv_lens[:i]) for i in range(len(kv_lens) + 1)]
    out = torch.empty_like(q, device=device)
    lse = torch.empty(q.shape[:2], device=device)
    paged_attention(
        q.to(device), k.to(device), v.to(device), out,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        block_tables=None, max_query_len=max(q_lens), max_seq_len=max(kv_lens), scale=0.3, causal=causal,
        lse=lse, kv_start_loc=torch.tensor(ksl, dtype=torch.int32, device=device), **kernel_options)
    for b in range(len(q_lens)):
        qs, ks = slice(qsl[b], qsl[b + 1]), slice(ksl[b], ksl[b + 1])
        ref_o, ref_l = dense_attention_with_lse(q[qs], k[ks], v[ks], scale=0.3, causal=causal)
        torch.testing.assert_close(out[qs].double().cpu(), ref_o, atol=tol, rtol=tol)
        torch.testing.assert_close(lse[qs].double().cpu(), ref_l, atol=tol, rtol=tol)
    return lse, qsl
