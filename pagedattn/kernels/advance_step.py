"""Advance a decode-only batch's step inputs by one token, on the device (multi-step decoding).

One program per BLOCK rows. Row b < num_queries: the sampled token becomes the next input
token, the position, seq_len and context_len grow by one, and the slot of the new token (at
position seq_len_new - 1) is recomputed from the block table:
`block_tables[b, (seq_len_new - 1) // block_size] * block_size + (seq_len_new - 1) % block_size`,
in int64. Rows num_queries..num_seqs are CUDA-graph padding: slot -1, nothing else touched.
No host synchronisation, so the update is captured with the decode graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check, check_tensor

_BLOCK = 128


@triton.jit(do_not_specialize=["num_seqs", "num_queries"])  # per-step counts: one variant for all
def _advance_step_kernel(
    input_tokens_ptr, input_positions_ptr, sampled_ptr, seq_lens_ptr, context_lens_ptr,
    slot_mapping_ptr, block_tables_ptr, num_seqs, num_queries, stride_sampled, stride_bt,
    BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = b < num_queries
    row = b < num_seqs
    b64 = b.to(tl.int64)
    tok = tl.load(sampled_ptr + b64 * stride_sampled, mask=live)
    tl.store(input_tokens_ptr + b64, tok, mask=live)
    pos = tl.load(input_positions_ptr + b64, mask=live)
    tl.store(input_positions_ptr + b64, pos + 1, mask=live)
    seq_len = tl.load(seq_lens_ptr + b64, mask=live, other=1) + 1
    tl.store(seq_lens_ptr + b64, seq_len, mask=live)
    ctx = tl.load(context_lens_ptr + b64, mask=live)
    tl.store(context_lens_ptr + b64, ctx + 1, mask=live)
    p = (seq_len - 1).to(tl.int64)
    block = tl.load(block_tables_ptr + b64 * stride_bt + p // BLOCK_SIZE, mask=live, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + p % BLOCK_SIZE
    tl.store(slot_mapping_ptr + b64, tl.where(live, slot, -1), mask=row)


def advance_step(
    input_tokens: torch.Tensor,
    input_positions: torch.Tensor,
    sampled_token_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    context_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    num_queries: int,
) -> None:
    """In place: advance the first `num_queries` of `num_seqs` decode sequences by one token.

    input_tokens, input_positions: [num_seqs] int64. sampled_token_ids: [num_queries, 1] int64
    (more rows are ignored). seq_lens, context_lens: [num_seqs] int32.
    slot_mapping: [num_seqs] int64. block_tables: [num_seqs, W] int32 (row stride free, column
    stride 1); must already hold the block of every sequence's new token.
    """
    check_tensor(input_tokens, "input_tokens", ndim=1, dtypes=(torch.int64,))
    device = input_tokens.device
    num_seqs = input_tokens.shape[0]
    for name, t, dtype in (("input_positions", input_positions, torch.int64),
                           ("seq_lens", seq_lens, torch.int32),
                           ("context_lens", context_lens, torch.int32),
                           ("slot_mapping", slot_mapping, torch.int64)):
        check_tensor(t, name, ndim=1, dtypes=(dtype,), device=device)
        check(t.shape[0] == num_seqs, f"{name}.shape[0]", num_seqs, t.shape[0])
        check(t.stride(0) == 1 or num_seqs <= 1, f"{name}.stride(0)", 1, t.stride(0))
    check(input_tokens.stride(0) == 1 or num_seqs <= 1, "input_tokens.stride(0)", 1,
          input_tokens.stride(0))
    check(0 <= num_queries <= num_seqs, "num_queries", f"0..{num_seqs}", num_queries)
    check_tensor(sampled_token_ids, "sampled_token_ids", ndim=2, dtypes=(torch.int64,),
                 device=device)
    check(sampled_token_ids.shape[0] >= num_queries and sampled_token_ids.shape[1] == 1,
          "sampled_token_ids.shape", f"[>= {num_queries}, 1]", tuple(sampled_token_ids.shape))
    check_tensor(block_tables, "block_tables", ndim=2, dtypes=(torch.int32,), device=device)
    check(block_tables.shape[0] == num_seqs, "block_tables.shape[0]", num_seqs,
          block_tables.shape[0])
    check(block_tables.stride(1) == 1 or block_tables.shape[1] <= 1, "block_tables.stride(1)",
          1, block_tables.stride(1))
    check(block_size >= 1, "block_size", ">= 1", block_size)
    if num_seqs == 0:
        return
    _advance_step_kernel[(triton.cdiv(num_seqs, _BLOCK),)](
        input_tokens, input_positions, sampled_token_ids, seq_lens, context_lens,
        slot_mapping, block_tables, num_seqs, num_queries, sampled_token_ids.stride(0),
        block_tables.stride(0), BLOCK_SIZE=block_size, BLOCK=_BLOCK, num_warps=4,
    )
