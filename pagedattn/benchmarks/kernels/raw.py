"""Our kernels called directly (`pagedattn.kernels`): `store_kv` then ONE `paged_attention`
launch for the whole step (prefills and decodes together), with the split-KV scratch every
backend shares (`shared_workspace`). Ragged cases read the step's contiguous K/V
(`kv_start_loc`) and store nothing."""

from __future__ import annotations

from pagedattn.kernels import paged_attention, shared_workspace, store_kv

from .step import Step
from .workload import InputSet, Workload


def prepare_raw(w: Workload) -> Step:
    c = w.case
    ws = shared_workspace(w.device, c.num_heads, c.num_kv_heads, c.head_size)
    max_seq_len = max(c.seq_lens)

    def call(s: InputSet) -> None:
        if c.paged:
            store_kv(s.key, s.value, s.cache[0], s.cache[1], w.slot_mapping, w.k_scale, w.v_scale)
            k, v, tables, kv_start = s.cache[0], s.cache[1], w.block_tables, None
        else:
            k, v, tables, kv_start = s.key, s.value, None, w.query_start_loc
        paged_attention(s.query, k, v, s.out, query_start_loc=w.query_start_loc, seq_lens=w.seq_lens,
                        block_tables=tables, max_query_len=c.max_query_len, max_seq_len=max_seq_len,
                        scale=w.scale, causal=True, sliding_window=c.sliding_window,
                        alibi_slopes=w.alibi_slopes, soft_cap=c.soft_cap, k_scale=w.k_scale,
                        v_scale=w.v_scale, workspace=ws, kv_start_loc=kv_start)

    return Step([lambda s=s: call(s) for s in w.sets], lambda: w.sets[0].out,
                store="store_kv" if c.paged else "-")
