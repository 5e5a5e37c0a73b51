"""The xFormers attention biases of the `xformers` backend's calls, built from a step's host facts.

xFormers' `memory_efficient_attention` takes the whole batch as one row of tokens
(`[1, T, ...]`) and an attention bias object that says which query sees which key; these
functions build that object for each kind of call of the shared forward:

- fresh prompts (context_len 0) over the step's own K/V: `BlockDiagonalCausalMask`, or
  `BlockDiagonalCausalLocalAttentionMask(W)` with a sliding window (query i sees keys
  i - W < j <= i), or per sequence a `LowerTriangularMaskWithTensorBias` carrying the ALiBi
  term `slope_h * (key_pos - query_pos)` (and the window, as -inf);
- encoder, encoder-only and cross attention over the step's K/V: `BlockDiagonalMask`;
- chunks over a cached prefix and decodes, through the block tables:
  `PagedBlockDiagonalCausalWithOffsetPaddedKeysMask` (causal from the bottom right: the last
  query of a sequence sees its last key); cross attention through the cross tables:
  `PagedBlockDiagonalPaddedKeysMask`. The keys are the cache's K half viewed as
  `[1, num_blocks * block_size, Hkv, D]`, which the `xformers` layout
  `(2, num_blocks, block_size * Hkv * D)` is without a copy.

Lengths come from host lists (the metadata's), so building a bias never reads the device; the
backend builds each bias once per step. Each function takes the `attn_bias` module of the fmha the
backend calls (`xformers.ops.fmha.attn_bias` or MSLK's `mslk.attention.fmha.attn_bias`, see
`xformers_fmha`): an operator accepts only its own module's classes. tests/backend_xformers checks
every bias here, materialised by xFormers itself, against the dense oracle.
"""

from __future__ import annotations

from types import ModuleType
from typing import Sequence

import torch

from pagedattn.intmath import cdiv

# cutlass reads a tensor bias with its last dimension's rows aligned to 8 elements
_BIAS_ALIGN = 8


def block_diagonal(xb: ModuleType, q_lens: Sequence[int], kv_lens: Sequence[int], *, causal: bool,
                   sliding_window: int | None, device: torch.device):
    """Sequence b's `q_lens[b]` queries over its `kv_lens[b]` keys, both laid out back to back.

    Causal biases are for fresh prompts (`q_lens == kv_lens`), where xFormers' top-left
    diagonal is the API's bottom-right one.
    """
    q_lens, kv_lens = list(q_lens), list(kv_lens)
    if not causal:
        if sliding_window is not None:
            raise ValueError(f"expected no sliding window for non-causal attention, got {sliding_window}")
        return xb.BlockDiagonalMask.from_seqlens(q_lens, kv_lens, device=device)
    if q_lens != kv_lens:
        raise ValueError(f"expected causal query lengths equal to the key lengths (fresh prompts), "
                         f"got {q_lens} and {kv_lens}")
    mask = xb.BlockDiagonalCausalMask.from_seqlens(q_lens, device=device)
    return mask if sliding_window is None else mask.make_local_attention(sliding_window)


def alibi(xb: ModuleType, slopes: torch.Tensor, seq_lens: Sequence[int], *, num_kv_heads: int,
          sliding_window: int | None, dtype: torch.dtype) -> list:
    """One causal bias per fresh prompt of `seq_lens[b]` tokens, holding the ALiBi term.

    Args:
        slopes: float32 [Hq] on the device of the attention.
        seq_lens: host [B].
        num_kv_heads: Hkv; the bias follows the backend's grouped query layout [1, T, Hkv, G, D]
            (xFormers' BMGHK), so it is [1, Hkv, G, L, L] (G = Hq / Hkv): xFormers selects each
            KV group's (or squeezes G = 1) bias with its queries'.
        dtype: the query's dtype (xFormers adds a tensor bias in it).
    Returns:
        B biases; bias b is [1, Hkv, G, L, L] (L = seq_lens[b]), a slice of rows padded to a
        multiple of 8.
    """
    out = []
    for n in seq_lens:
        pos = torch.arange(n, device=slopes.device, dtype=torch.float32)
        rel = pos[None, :] - pos[:, None]  # [L, L] key_pos - query_pos
        bias = slopes[:, None, None] * rel  # [Hq, L, L]
        if sliding_window is not None:
            bias = bias.masked_fill(rel <= -sliding_window, float("-inf"))
        # built 5-D and sliced (a view of a 4-D tensor would reset a 1-row stride): rows stay aligned
        padded = torch.empty(1, num_kv_heads, bias.shape[0] // num_kv_heads, n, cdiv(n, _BIAS_ALIGN) * _BIAS_ALIGN,
                             dtype=dtype, device=bias.device)
        padded[..., :n] = bias.unflatten(0, (num_kv_heads, -1))
        out.append(xb.LowerTriangularMaskWithTensorBias(padded[..., :n]))
    return out


def paged(xb: ModuleType, q_lens: Sequence[int], kv_lens: Sequence[int], block_tables: torch.Tensor, block_size: int, *,
          causal: bool):
    """Sequence b's `q_lens[b]` queries (back to back) over its first `kv_lens[b]` keys through
    `block_tables[b]` (int32 [B, W], block ids into the cache's blocks of `block_size` slots).

    Causal: bottom-right aligned (a chunk over a cached prefix, a decode).
    """
    kind = xb.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask if causal else xb.PagedBlockDiagonalPaddedKeysMask
    return kind.from_seqlens(list(q_lens), list(kv_lens), block_tables, block_size, device=block_tables.device)
