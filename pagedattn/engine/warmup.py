"""Dummy steps run once at start-up on CUDA, so kernels compile before requests arrive.

Triton compiles one binary per kernel variant on its first launch: per constexpr (the
paged-attention kernel's tile, which follows the step's longest query and, for its keys, its
longest sequence; split-KV or not; over the pages or over the step's own rows) and per class of
each specialised integer argument (1, a multiple of 16, other). Each compile takes a second or
more; met mid-run it stalls every running request behind it. An offline batch meets few
variants, a server meets them as its batches change: on the H100, 8 requests/s of ShareGPT-like
lengths saw inter-token gaps of 1.8 s at p99. The steps here are shaped like what requests
bring, at each context class the backend's plan tells apart (`plan_lengths`: the sequence
lengths where its tiles change, `AttentionBackend.plan_context_lens`), as far as the engine's
limits reach:
- fresh prompts of 1 token up to 1024 (every query-tile class; keys read from the step's rows),
  and one of the whole token budget: a long prompt's first chunk, which takes the long
  contiguous tile where the budget reaches that tile's threshold;
- chunks over a prefix, alone (split-KV launches, few programs) and as many as a step holds (the
  unsplit launch over the pages), at three context lengths: PREFIX_LEN + the chunk (mid decode
  key tiles; every query length); SHORT_KEYS (short decode key tiles; SHORT_QUERY_LENS); the
  longer of LONG_KEYS and LONG_PREFILL_KEYS (long decode and paged prefill key tiles;
  LONG_QUERY_LENS);
- a chunk of the whole budget over a long prefix: a long prompt's later chunks (long-tiled and
  unsplit however many programs one chunk has);
- a prefill beside running decodes (mixed steps), with few and many decodes, at PREFIX_LEN and
  at the long context (its prefill tile is the long one).
Limits clip each length (a class the engine cannot reach is not warmed, and shapes clipped to
the same one run once). Their tokens go to the first blocks of the pool, before any request
owns a block: each request writes its own K/V before it reads it, so what they leave there is
never read.
"""

from __future__ import annotations

from pagedattn.attention.types import ScheduledSeq
from pagedattn.intmath import cdiv

QUERY_LENS = (1, 2, 3, 4, 7, 8, 16, 17, 32, 48, 64, 100, 128, 256, 512, 1024)
PREFIX_LEN = 1024  # a chunk over this many keys splits when few sequences run
# Powers of two reach every row class of any GQA group (next_pow2(q * group) doubles with q).
# Decode key tiles follow the context up to 32 rows (q <= 32 for any group); at long contexts
# the prefill tile does too, one query tile or several (256 tokens: several for any group).
SHORT_QUERY_LENS = (1, 2, 4, 8, 16, 32)
LONG_QUERY_LENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIXED_PREFILL_LEN = 100
MIXED_DECODES = (1, 15, 16, 63)


def warmup_steps(*, block_size: int, num_blocks: int, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, plan_lengths: tuple[int, ...] = ()) -> list[list[ScheduledSeq]]:
    """The dummy steps, each a list of `ScheduledSeq` within the engine's limits (tokens per
    step, sequences per step, the model's context, the pool's blocks), at the backend's
    `plan_lengths` (none: PREFIX_LEN stands for every class)."""
    max_len = min(max_model_len, num_blocks * block_size)
    budget = min(max_num_batched_tokens, max_len)
    short_keys = min(plan_lengths, default=PREFIX_LEN)
    long_keys = max(plan_lengths, default=PREFIX_LEN)  # from here decode and paged prefill tiles are long

    def seq(seq_len: int, query_len: int) -> ScheduledSeq:
        return ScheduledSeq(seq_len, query_len, list(range(cdiv(seq_len, block_size))))

    def chunks(seq_len: int, q: int) -> list[list[ScheduledSeq]]:
        """A chunk of `q` tokens ending at key `seq_len` (clipped to the model), alone and as
        many as the step holds; none where no prefix fits."""
        seq_len = min(seq_len, max_len)
        if seq_len <= q:
            return []
        many = min(max_num_seqs, max_num_batched_tokens // q)
        return [[seq(seq_len, q)]] + ([[seq(seq_len, q)] * many] if many > 1 else [])

    queries = [q for q in QUERY_LENS if q <= budget]
    steps = [[seq(q, q)] for q in queries + [budget]]
    for q in queries:
        steps += chunks(PREFIX_LEN + q, q)
    for q in SHORT_QUERY_LENS:
        steps += chunks(short_keys, q)
    for q in LONG_QUERY_LENS:
        steps += chunks(long_keys, q)
    steps += chunks(long_keys + budget, budget)
    prefill = min(MIXED_PREFILL_LEN, budget)
    for context in (PREFIX_LEN, long_keys):
        context = min(context, max_len - 1)
        for decodes in MIXED_DECODES:
            decodes = min(decodes, max_num_seqs - 1, max_num_batched_tokens - prefill)
            if decodes >= 1 and context >= 1:
                steps.append([seq(prefill, prefill)] + [seq(context + 1, 1)] * decodes)
    return _unique(steps)


def _unique(steps: list[list[ScheduledSeq]]) -> list[list[ScheduledSeq]]:
    """`steps` in order, each shape once (small limits clip several classes to one shape)."""
    seen: set[tuple[tuple[int, int], ...]] = set()
    out = []
    for seqs in steps:
        shape = tuple((s.seq_len, s.query_len) for s in seqs)
        if shape not in seen:
            seen.add(shape)
            out.append(seqs)
    return out
