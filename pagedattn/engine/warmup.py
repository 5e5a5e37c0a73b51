"""Dummy steps run once at start-up on CUDA, so kernels compile before requests arrive.

Triton compiles one binary per kernel variant on its first launch: per constexpr (the
paged-attention kernel's query tile, which follows the longest query of the step; split-KV or
not; over the pages or over the step's own rows) and per class of each specialised integer
argument (1, a multiple of 16, other). Each compile takes a second or more; met mid-run it
stalls every running request behind it. An offline batch meets few variants, a server meets
them as its batches change: on the H100, 8 requests/s of ShareGPT-like lengths saw inter-token
gaps of 1.8 s at p99. The steps here are shaped like what requests bring:
- fresh prompts of 1 token up to the step's token budget (every query-tile class);
- the same query lengths as chunks over a long prefix (split-KV launches, few programs);
- many such chunks at once (the unsplit launch over the pages);
- a prefill beside running decodes (mixed steps), with few and many decodes.
Their tokens go to the first blocks of the pool, before any request owns a block: each request
writes its own K/V before it reads it, so what they leave there is never read.
"""

from __future__ import annotations

from pagedattn.attention.types import ScheduledSeq
from pagedattn.intmath import cdiv

QUERY_LENS = (1, 2, 3, 4, 7, 8, 16, 17, 32, 48, 64, 100, 128, 256, 512, 1024)
PREFIX_LEN = 1024  # a chunk over this many keys splits when few sequences run
MIXED_PREFILL_LEN = 100
MIXED_DECODES = (1, 15, 16, 63)


def warmup_steps(*, block_size: int, num_blocks: int, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int) -> list[list[ScheduledSeq]]:
    """The dummy steps, each a list of `ScheduledSeq` within the engine's limits (tokens per
    step, sequences per step, the model's context, the pool's blocks)."""
    max_len = min(max_model_len, num_blocks * block_size)
    budget = min(max_num_batched_tokens, max_len)

    def seq(seq_len: int, query_len: int) -> ScheduledSeq:
        return ScheduledSeq(seq_len, query_len, list(range(cdiv(seq_len, block_size))))

    steps: list[list[ScheduledSeq]] = []
    queries = [q for q in QUERY_LENS if q <= budget]
    for q in queries:
        steps.append([seq(q, q)])
        prefix = min(PREFIX_LEN, max_len - q)
        if prefix > 0:
            steps.append([seq(prefix + q, q)])
            many = min(max_num_seqs, max_num_batched_tokens // q)
            if many > 1:
                steps.append([seq(prefix + q, q)] * many)
    prefill = min(MIXED_PREFILL_LEN, budget)
    context = min(PREFIX_LEN, max_len - 1)
    for decodes in MIXED_DECODES:
        decodes = min(decodes, max_num_seqs - 1, max_num_batched_tokens - prefill)
        if decodes >= 1 and context >= 1:
            steps.append([seq(prefill, prefill)] + [seq(context + 1, 1)] * decodes)
    return steps
