"""Mixed launches of paged_attention (issue #12): a prefill-tiled step whose last `num_decodes`
sequences are decodes gives them programs of a decode tile in the same launch. Every case checks
that the launch took that path, then compares with the dense float64 oracle on shuffled pages."""

import importlib

import pytest
import torch

pytest.importorskip("triton")

from cases import GPU_ONLY_GRID  # noqa: E402
from oracle import rel_l2  # noqa: E402
from paged_kernel import attend, check_contiguous_kv, kernel_args, kernel_batch, oracle_options  # noqa: E402

from pagedattn.kernels import SplitKVWorkspace  # noqa: E402
from pagedattn.kernels import paged_attention_config as config  # noqa: E402

launcher = importlib.import_module("pagedattn.kernels.paged_attention")  # the package's name is the function

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
H100_SMS = 132

# (context_len, query_len) per sequence, prefills first, and how many of the last are decodes.
# At GQA 4 a step is prefill-tiled (128 rows) from 17 query tokens, at GQA 1 from 65. A context
# of 0 with one query is a sequence of length 1 (the metadata's prefill rule calls it one; the
# kernel only needs the tail's query lengths within the decode tile).
MIXED = {
    "chunk_and_decodes": ([(35, 40), (50, 1), (15, 1), (16, 1), (1, 1)], 4),
    "prompts_and_decodes": ([(0, 23), (0, 18), (0, 1), (69, 1), (3, 1)], 3),  # (0, 1) counted a decode
    "one_decode": ([(20, 70), (33, 1)], 1),
    "many_decodes": ([(4, 17)] + [(c, 1) for c in (1, 8, 17, 31, 40, 2, 63, 9, 5)], 9),
}


from pagedattn.kernels.attention_plan import plan_attention  # noqa: E402


class _LaunchSpy:
    """Stands in for the kernel; records whether each launch was mixed."""

    def __init__(self, kernel):
        self.kernel, self.mixed = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.mixed.append(kwargs["MIXED"])
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.fixture
def spy(monkeypatch):
    """The portable kernel's launches; the Gluon prefill kernel, which takes 16-bit paged steps
    on an H100/H200 (mixed ones too), is turned off: these tests are about the mixed launch."""
    s = _LaunchSpy(launcher._paged_attention_kernel)
    monkeypatch.setattr(launcher, "_paged_attention_kernel", s)
    monkeypatch.setattr(launcher.hopper_prefill, "takes", lambda *a, **k: False)
    plan_attention.cache_clear()  # plans made with the Gluon kernel on
    return s


# The model dtype of most cases: float32 under the interpreter (exact enough for tight bounds);
# float16 on CUDA, where float32 launches keep 64-row prefill tiles and so never mix.
DTYPE = torch.float32 if DEVICE == "cpu" else torch.float16


def make(lens, *, num_heads=8, num_kv_heads=2, head_size=32, block_size=16, dtype=DTYPE, **options):
    return kernel_batch(lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                        block_size=block_size, dtype=dtype, device=DEVICE, **options)


def scales_of(batch):
    if not batch.fp8:
        return {}
    return dict(k_scale=torch.tensor(batch.k_scale, device=DEVICE),
                v_scale=torch.tensor(batch.v_scale, device=DEVICE))


def check_mixed(spy, batch, num_decodes, *, lse_atol=1e-3, **kernel_options):
    """The mixed launch against the oracle, and against the same launch without `num_decodes`
    (every sequence in the prefill tile)."""
    scale = batch.head_size ** -0.5
    args = kernel_args(batch)
    out, lse = attend(args, scale=scale, num_decodes=num_decodes, **scales_of(batch), **kernel_options)
    assert spy.mixed[-1], "the decodes did not get a tile of their own"
    ref_out, ref_lse = batch.reference(scale=scale, **oracle_options(kernel_options))
    assert rel_l2(out, ref_out) <= TOL[batch.dtype]
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=lse_atol, rtol=1e-4)
    single = {k: v for k, v in kernel_options.items() if k != "decode_tile"}
    one_tile, one_lse = attend(args, scale=scale, **scales_of(batch), **single)
    assert not spy.mixed[-1]
    assert rel_l2(out, one_tile) <= TOL[batch.dtype]
    torch.testing.assert_close(lse, one_lse, atol=lse_atol, rtol=1e-4)
    return out


@pytest.mark.parametrize("shape", list(MIXED))
@pytest.mark.parametrize("block_size", [1, 16])
def test_mixed_shapes(spy, shape, block_size):
    lens, num_decodes = MIXED[shape]
    check_mixed(spy, make(lens, block_size=block_size), num_decodes)


@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa4", "gqa1"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_mixed_gqa(spy, heads, block_size):
    lens = [(10, 70), (0, 66), (0, 1), (40, 1), (17, 1)] if heads[0] == heads[1] else MIXED["chunk_and_decodes"][0]
    check_mixed(spy, make(lens, num_heads=heads[0], num_kv_heads=heads[1], block_size=block_size), 3)


# each option alone at block size 16, all of them at 1 and 16 (the rest on CUDA)
@pytest.mark.parametrize("block_size, options", [
    pytest.param(bs, opts, id=f"{bs}-{name}", marks=GPU_ONLY_GRID if bs == 1 and name != "all" else ())
    for bs in (1, 16)
    for name, opts in (("window", dict(sliding_window=7)), ("soft_cap", dict(soft_cap=1.5)),
                       ("alibi", dict(alibi=True)), ("all", dict(sliding_window=13, soft_cap=2.0, alibi=True)))])
def test_mixed_options_move_the_output(spy, options, block_size):
    batch = make(MIXED["chunk_and_decodes"][0], block_size=block_size)
    options = dict(options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.3, 0.2, 0.1, 0.05],
                                               device=DEVICE)
    out = check_mixed(spy, batch, 4, **options)
    plain, _ = attend(kernel_args(batch), scale=batch.head_size ** -0.5, num_decodes=4)
    assert rel_l2(out[-4:], plain[-4:]) > 1e-2  # the decodes' rows honour the option too


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_fp8_cache(spy, kv_cache_dtype, dtype):
    batch = make(MIXED["chunk_and_decodes"][0], head_size=64, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                 k_scale=0.3, v_scale=1.7)
    check_mixed(spy, batch, 4)


@pytest.mark.parametrize("num_splits", [pytest.param(2, marks=GPU_ONLY_GRID), 3])  # 3: uneven shares
def test_mixed_split_kv(spy, num_splits):
    """Both bodies split their keys; the decodes' partials merge like the prefill's."""
    batch = make([(60, 20), (0, 1), (100, 1), (45, 1)], block_size=5)
    ws = SplitKVWorkspace.allocate(batch.num_tokens, 8, 32, 4, DEVICE)
    ws.partial_out.fill_(float("nan"))
    ws.partial_stats.fill_(float("nan"))
    check_mixed(spy, batch, 3, workspace=ws, num_splits=num_splits, sliding_window=50)


@pytest.mark.parametrize("lead", [0.0, 0.5, 1.0])
def test_every_slot_layout_covers_every_program(spy, monkeypatch, lead):
    """From decodes interleaved from the first slot to every prefill tile first: each query
    tile and each decode gets exactly one program (a missed one leaves its rows unwritten)."""
    monkeypatch.setattr(config, "MIXED_PREFILL_LEAD", lead)
    lens, num_decodes = MIXED["many_decodes"]
    check_mixed(spy, make([(30, 45)] + lens, block_size=16), num_decodes)


def test_multi_token_decodes(spy):
    """Decodes of up to `max_decode_query_len` queries each (speculative decoding) fit the tile."""
    batch = make([(20, 40), (9, 3), (30, 2), (5, 3)])
    out, _ = attend(kernel_args(batch), scale=0.3, num_decodes=3, max_decode_query_len=3)
    assert spy.mixed[-1]
    ref, _ = batch.reference(scale=0.3)
    assert rel_l2(out, ref) <= TOL[DTYPE]


@pytest.mark.parametrize("causal", [True, False])
def test_mixed_contiguous_kv(spy, causal):
    """Keys as rows of contiguous [total_kv, Hkv, D] tensors (`kv_start_loc`): fresh prompts
    (causal: one key per decode-like sequence of length 1) or cross attention (non-causal)."""
    q_lens = [40, 1, 1, 2]
    kv_lens = q_lens if causal else [30, 50, 7, 0]
    lse, qsl = check_contiguous_kv(q_lens, kv_lens, num_heads=8, num_kv_heads=2, causal=causal, dtype=DTYPE,
                                   device=DEVICE, tol=1e-5 if DTYPE == torch.float32 else 4e-3, seed=11,
                                   num_decodes=3, max_decode_query_len=2)
    assert spy.mixed[-1]
    if not causal:
        assert torch.isneginf(lse[qsl[3]:]).all()  # a decode with no keys: empty


@pytest.mark.parametrize("decode_tile", [(16, 2), (64, 3, 32)])
def test_forced_decode_tile_agrees(spy, decode_tile):
    lens, num_decodes = MIXED["chunk_and_decodes"]
    check_mixed(spy, make(lens, block_size=5), num_decodes, decode_tile=decode_tile)


def test_decode_tile_and_num_decodes_refused_with_the_reason():
    args = kernel_args(make(MIXED["chunk_and_decodes"][0]))
    with pytest.raises(ValueError, match="expected 0..5"):
        attend(args, scale=1.0, num_decodes=6)
    with pytest.raises(ValueError, match="decode_tile: expected a launch whose decodes"):
        attend(args, scale=1.0, decode_tile=(64, 2))  # no num_decodes: nothing to give it to
    with pytest.raises(ValueError, match="decode_tile rows"):
        attend(args, scale=1.0, num_decodes=4, max_decode_query_len=5, decode_tile=(64, 2, 16))
    decode_only = kernel_args(make([(30, 1), (3, 1)]))
    with pytest.raises(ValueError, match="decode_tile: expected"):  # one tile for all already
        attend(decode_only, scale=1.0, num_decodes=2, decode_tile=(64, 2))


def test_without_a_narrower_tile_the_launch_is_unchanged(spy):
    """Decodes already in the launch's tile (a decode-like step) or too wide for a decode tile
    (GQA 8 with 16-query decodes: 128 rows) keep today's single-tile launch."""
    attend(kernel_args(make([(30, 3), (3, 1), (9, 1)])), scale=0.5, num_decodes=2)
    attend(kernel_args(make([(30, 40), (3, 16), (9, 16)], num_heads=8, num_kv_heads=1)), scale=0.5,
           num_decodes=2, max_decode_query_len=16)
    assert spy.mixed == [False, False]


# ----------------------------------------------------------------------------- the policy


def test_the_issue_12_step_gets_a_16_row_decode_tile_with_the_prefill_warps():
    """A 2k chunk over 2k keys and 64 decodes of 2k at 32/8/128 bf16: the prefill tile stays
    (128 rows, 8 warps); the decodes fill 16 rows (4 tokens' worth) instead of 128."""
    prefill = config.choose_tile(head_size=128, group=4, max_query_len=2048, elem_bytes=2, interpret=False,
                                 max_seq_len=4096, num_seqs=65, num_kv_heads=8, num_sms=H100_SMS)
    assert (prefill.block_m, prefill.num_warps) == (128, 8)
    dec = config.choose_mixed_decode_tile(prefill, head_size=128, group=4, max_decode_query_len=1,
                                          elem_bytes=2, interpret=False)
    assert (dec.block_q, dec.block_m, dec.num_warps) == (4, 16, 8)
    assert (dec.block_n, dec.num_stages) == config.MIXED_DECODE_TILES[128]


@pytest.mark.parametrize("head_size", [32, 64, 80, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8, 16])
def test_every_head_size_and_group_has_a_decode_tile(head_size, group):
    prefill = config.choose_tile(head_size=head_size, group=group, max_query_len=512, elem_bytes=2,
                                 interpret=False, max_seq_len=1024, num_seqs=9, num_kv_heads=2, num_sms=H100_SMS)
    dec = config.choose_mixed_decode_tile(prefill, head_size=head_size, group=group, max_decode_query_len=1,
                                          elem_bytes=2, interpret=False)
    assert dec.block_m == max(16, group) and dec.block_q * group == dec.block_m
    assert dec.num_warps == prefill.num_warps


def test_mixed_lead_is_a_share_of_the_prefill_tiles(monkeypatch):
    for lead, want in ((0.0, 0), (0.5, 50), (1.0, 100)):
        monkeypatch.setattr(config, "MIXED_PREFILL_LEAD", lead)
        assert config.mixed_lead(100) == want


@pytest.mark.skipif(DEVICE != "cuda", reason="realistic sizes: GPU only")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_mixed_step_realistic_gpu(spy, kv_cache_dtype):
    """The issue's shape, scaled down: a 512-token chunk over 512 keys and 32 decodes of up to
    1.5k at 32/8/128 bf16."""
    lens = [(512, 512)] + [(100 + 45 * i, 1) for i in range(32)]
    batch = make(lens, num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
                 kv_cache_dtype=kv_cache_dtype)
    check_mixed(spy, batch, 32, lse_atol=2e-3)
