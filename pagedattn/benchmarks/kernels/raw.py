"""Our kernels called directly (`pagedattn.kernels`): ONE `paged_attention` launch for the whole
step (prefills and decodes together) that also stores the step's K/V (`write`: decode programs
write their own rows, other launches run `store_kv` first), with the split-KV scratch every
backend shares (`shared_workspace`). Ragged cases read the step's contiguous K/V
(`kv_start_loc`) and store nothing. `num_splits` forces the split-KV count (the `raw-s<N>` rows
of `--splits`) and `tile` the (keys per step, warps, stages) of the launch (the `raw-n<K>w<W>s<S>`
rows of `--tiles`), to tune the policies against; None lets the policy choose. A mixed step's
decodes are named to the launch (`num_decodes`), as the `triton` backend names them."""

from __future__ import annotations

from pagedattn.kernels import KVWrite, paged_attention, shared_workspace

from .step import NotApplicable, Step
from .workload import InputSet, Workload


def prepare_raw(w: Workload, num_splits: int | None = None, tile: tuple | None = None) -> Step:
    c = w.case
    ws = shared_workspace(w.device, c.num_heads, c.num_kv_heads, c.head_size)
    max_seq_len = max(c.seq_lens)
    num_tokens = w.sets[0].query.shape[0]
    if num_splits is not None and num_splits > ws.splits_for(num_tokens, c.num_heads, c.head_size):
        raise NotApplicable(f"{num_splits} splits of {num_tokens} tokens exceed the shared "
                            f"workspace ({ws.rows} rows, at most {ws.max_splits} splits)")

    def call(s: InputSet) -> None:
        if c.paged:
            k, v, tables, kv_start = s.cache[0], s.cache[1], w.block_tables, None
            write = KVWrite(s.key, s.value, k, v, w.slot_mapping)
        else:
            k, v, tables, kv_start, write = s.key, s.value, None, w.query_start_loc, None
        paged_attention(s.query, k, v, s.out, query_start_loc=w.query_start_loc, seq_lens=w.seq_lens,
                        block_tables=tables, max_query_len=c.max_query_len, max_seq_len=max_seq_len,
                        scale=w.scale, causal=True, sliding_window=c.sliding_window,
                        alibi_slopes=w.alibi_slopes, soft_cap=c.soft_cap, k_scale=w.k_scale,
                        v_scale=w.v_scale, workspace=ws, kv_start_loc=kv_start, num_splits=num_splits,
                        tile=tile, num_decodes=c.num_seqs - c.num_prefills if c.paged else 0,
                        write=write)

    return Step([lambda s=s: call(s) for s in w.sets], lambda: w.sets[0].out,
                store="write" if c.paged else "-")
