"""The start-up warm-up's dummy steps stay inside the engine's limits and cover the shape classes:
every tile the paged-attention policy picks for a step the engine can run, some warm-up step
picks too, so no request waits for that variant to compile."""

import functools
import warnings

import pytest
import torch

from pagedattn.attention.types import ScheduledSeq
from pagedattn.backends.triton_backend import TritonBackend
from pagedattn.engine.warmup import warmup_steps
from pagedattn.kernels.paged_attention_config import LONG_KEYS, LONG_PREFILL_KEYS, choose_tile

PLAN_LENGTHS = TritonBackend.plan_context_lens()

TYPICAL = dict(block_size=16, num_blocks=65536, max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=32768)
SMALL = dict(block_size=16, num_blocks=64, max_num_batched_tokens=512, max_num_seqs=8, max_model_len=2048)
LIMITS = [
    dict(block_size=16, num_blocks=4096, max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=8192),
    SMALL,
    dict(block_size=1, num_blocks=300, max_num_batched_tokens=128, max_num_seqs=4, max_model_len=256),
    dict(block_size=16, num_blocks=1, max_num_batched_tokens=16, max_num_seqs=1, max_model_len=16),
    TYPICAL,
    # a budget below the contiguous long tile's threshold: long prompts arrive as chunks
    dict(block_size=16, num_blocks=65536, max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=32768),
]
H100_SMS = 132
# (query heads, KV heads, head size)
MODELS = {"gqa4-d128": (32, 8, 128), "gqa4-d64": (32, 8, 64), "mha-d128": (32, 32, 128), "gqa8-1kv-d128": (8, 1, 128)}


@pytest.mark.parametrize("limits", LIMITS)
def test_steps_fit_the_engine(limits):
    steps = warmup_steps(**limits, plan_lengths=PLAN_LENGTHS)
    assert steps
    for seqs in steps:
        assert 1 <= len(seqs) <= limits["max_num_seqs"]
        assert sum(s.query_len for s in seqs) <= limits["max_num_batched_tokens"]
        for s in seqs:
            assert s.seq_len <= limits["max_model_len"]
            assert len(s.block_table) * limits["block_size"] >= s.seq_len
            assert all(0 <= b < limits["num_blocks"] for b in s.block_table)


def test_steps_cover_the_shape_classes():
    steps = warmup_steps(**LIMITS[0], plan_lengths=PLAN_LENGTHS)
    longest = {max(s.query_len for s in seqs) for seqs in steps}
    assert {1, 8, 16, 17, 512, 1024} <= longest  # decode-like, each tile class, prefill-like
    assert any(len(seqs) == 1 and seqs[0].context_len >= 1000 for seqs in steps)  # a chunk that splits
    assert any(len(seqs) > 100 and seqs[0].context_len > 0 for seqs in steps)  # many chunks over pages
    assert any(seqs[0].context_len == 0 and seqs[0].query_len > 1 and len(seqs) > 1
               and all(s.query_len == 1 for s in seqs[1:]) for seqs in steps)  # a prefill beside decodes


def test_steps_reach_the_long_contexts():
    """The finding this guards: steps of at most 1k keys left every long tile to compile mid-run."""
    steps = warmup_steps(**TYPICAL, plan_lengths=PLAN_LENGTHS)
    decodes = [seqs for seqs in steps if all(s.query_len == 1 and s.context_len > 0 for s in seqs)]
    assert {len(seqs) for seqs in decodes if seqs[0].seq_len >= LONG_KEYS} >= {1, TYPICAL["max_num_seqs"]}
    assert any(seqs[0].context_len >= LONG_PREFILL_KEYS and seqs[0].query_len >= 256 for seqs in steps)
    budget = TYPICAL["max_num_batched_tokens"]
    assert [[(budget, budget)]] == [[(s.seq_len, s.query_len) for s in seqs] for seqs in steps
                                    if seqs[0].query_len == budget and seqs[0].context_len == 0]
    assert any(seqs[0].query_len == budget and seqs[0].context_len > 0 for seqs in steps)  # its later chunks
    assert any(seqs[0].context_len == 0 and len(seqs) > 1 and seqs[-1].context_len >= LONG_PREFILL_KEYS
               for seqs in steps)  # a prefill beside decodes at a long context


# ---------------------------------------------------------------- the tile policy's classes

def launch(seqs: list[ScheduledSeq]) -> tuple[int, int, int, bool]:
    """(max_query_len, max_seq_len, num_seqs, paged) of the triton backend's one launch for the
    step `seqs`: a step of fresh prompts only reads its keys from the step's rows, any other
    reads the pages (`test_launch_is_the_backends` holds this to the backend's own call)."""
    fresh_prompts_only = all(s.context_len == 0 for s in seqs)
    return max(s.query_len for s in seqs), max(s.seq_len for s in seqs), len(seqs), not fresh_prompts_only


def tile(params: tuple[int, int, int, bool], model: tuple[int, int, int]):
    """(paged, the tile `choose_tile` picks) for a launch of a 16-bit model on an H100."""
    max_query_len, max_seq_len, num_seqs, paged = params
    num_heads, num_kv_heads, head_size = model
    return paged, choose_tile(head_size=head_size, group=num_heads // num_kv_heads, max_query_len=max_query_len,
                              elem_bytes=2, interpret=False, max_seq_len=max_seq_len, num_seqs=num_seqs,
                              num_kv_heads=num_kv_heads, num_sms=H100_SMS, paged=paged)


def lengths(limit: int) -> list[int]:
    """1..limit: each power of two, its neighbours, the midpoint to the next one, and `limit`."""
    out, p = {limit}, 1
    while p <= limit:
        out |= {p - 1, p, p + 1, p + p // 2}
        p *= 2
    return sorted(x for x in out if 1 <= x <= limit)


@functools.cache
def plausible_launches(block_size, num_blocks, max_num_batched_tokens, max_num_seqs, max_model_len):
    """`launch(step)` of the steps a server under these limits runs (`q + n - 1` tokens at most
    the budget): n fresh prompts, the longest of q tokens; a chunk of q tokens (q = 1: a decode)
    ending at key seq_len beside n - 1 decodes there; a fresh prompt of q tokens beside n - 1
    decodes at q keys."""
    max_len = min(max_model_len, num_blocks * block_size)
    out = set()
    for q in lengths(min(max_num_batched_tokens, max_len)):
        for n in lengths(min(max_num_seqs, max_num_batched_tokens - q + 1)):
            out.add((q, q, n, False))
            out |= {(q, seq_len, n, True) for seq_len in lengths(max_len)
                    if seq_len > q or (seq_len == q > 1 and n > 1)}
    return frozenset(out)


def test_launch_is_the_backends():
    """`launch` agrees with the `AttendCall` the triton backend builds from the step's metadata,
    for every warm-up step and a step of each kind `plausible_launches` stands for."""
    impl = TritonBackend.get_impl_cls()(num_heads=1, head_size=16, scale=1.0)
    kinds = [[(100, 100), (1, 1)], [(300, 100), (300, 1)], [(100, 100), (100, 1)], [(300, 1)] * 3]
    kinds = [[ScheduledSeq(seq_len, q, range(seq_len)) for seq_len, q in seqs] for seqs in kinds]  # tables long enough
    for limits in (TYPICAL, SMALL):
        builder = TritonBackend.get_builder_cls()(limits["block_size"], "cpu")
        for seqs in warmup_steps(**limits, plan_lengths=PLAN_LENGTHS) + kinds:
            md = builder.build(seqs)
            rows = torch.empty(md.num_tokens, 0)  # [T, 0]: `_calls` only slices the step's rows
            (call,) = impl._calls(rows, rows, rows, rows, rows, md)
            assert launch(seqs) == (call.max_query_len, call.max_kv_len, call.query_start_loc.numel() - 1,
                                    not call.keys_are_step_rows)


UNBOUNDED = dict(block_size=16, num_blocks=1 << 20, max_num_batched_tokens=1 << 17, max_num_seqs=1024,
                 max_model_len=1 << 17)


@functools.cache
def policy_tiles(model: tuple[int, int, int]) -> frozenset:
    """Every tile the policy picks for some step of an engine with (almost) no limits."""
    return frozenset(tile(p, model) for p in plausible_launches(**UNBOUNDED))


@pytest.mark.parametrize("model", MODELS.values(), ids=MODELS.keys())
@pytest.mark.parametrize("limits", [TYPICAL, SMALL, LIMITS[-1]], ids=["typical", "small", "small-budget"])
def test_warmup_picks_every_tile_real_steps_pick(limits, model):
    real = {tile(p, model) for p in plausible_launches(**limits)}
    warmed = {tile(launch(seqs), model) for seqs in warmup_steps(**limits, plan_lengths=PLAN_LENGTHS)}
    missing = names(real - warmed)
    assert not missing, f"expected the warm-up to pick every tile real steps pick, got {missing} unpicked"
    unreachable = names(policy_tiles(model) - real)
    if unreachable:  # not a failure: no step within these limits needs them
        warnings.warn(f"tiles unreachable within {limits}, so not warmed: {unreachable}", stacklevel=1)


def names(tiles) -> list[str]:
    """`tile()` results as 'paged 16x128 keys, 4 warps, 2 stages' (rows x keys), sorted."""
    return sorted(f"{'paged' if paged else 'contiguous'} {t.block_m}x{t.block_n} keys, {t.num_warps} warps, "
                  f"{t.num_stages} stages" for paged, t in tiles)
