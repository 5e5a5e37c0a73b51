"""`pagedattn bench kernels` on the CPU: its case lists, the floor arithmetic, the report files
and the step it feeds the backends (checked against the oracle). No timing: benchmarks are
commands, never timed tests."""

from __future__ import annotations

import csv
import json
import math
import random

import pytest
import torch

import pagedattn
from oracle import dense_attention, rel_l2
from pagedattn.benchmarks.kernels import cases as C
from pagedattn.benchmarks.kernels import main, parse_args
from pagedattn.benchmarks.kernels.floors import keys_read, visible_pairs, work
from pagedattn.benchmarks.kernels.report import ENV_FIELDS, ROW_FIELDS, make_row, markdown, write_all
from pagedattn.benchmarks.kernels.tiles import parse_tile, tile_label

CEILINGS = dict(copy_gbs=3000.0, read_gbs=3200.0, matmul_tflops=800.0)


# ----------------------------------------------------------------------------- cases


def test_every_case_name_is_unique_and_every_quick_name_exists():
    everything = C.select(["all"])
    names = [c.name for c in everything]
    assert len(names) == len(set(names)), "two cases share a name"
    for grid, quick in C.QUICK.items():
        in_grid = {c.name for c in C.select([grid])}
        assert set(quick) <= in_grid, f"--quick names missing from {grid}: {set(quick) - in_grid}"
    assert 10 <= len(C.select(["all"], quick=True)) <= 20


def test_decode_grid_is_the_issue_grid_times_block_and_kv_dtype():
    decode = C.decode_cases()
    main_grid = [c for c in decode if c.name.endswith(("bf16", "fp8_e4m3"))]
    assert len(main_grid) == 4 * 3 * 2 * 2 * 2
    cells = {(c.num_seqs, c.seq_lens[0], (c.num_heads, c.num_kv_heads, c.head_size), c.block_size, c.kv_dtype)
             for c in main_grid}
    assert len(cells) == 96
    assert {c.block_size for c in main_grid} == {1, 16}
    for c in decode:
        assert c.is_decode and c.timing == "graph", c.name
    variants = [c for c in decode if c.features]
    assert {c.features for c in variants} == {"window 128", "window 4096", "soft cap 50", "ALiBi"}
    assert all(sum(c.seq_lens) <= 100_000 for c in variants)  # the torch reference runs on them
    ragged = [c for c in decode if "ragged" in c.name]
    assert len(ragged) == 3 and not any(c.uniform for c in ragged)


def test_prefill_long_chunked_mixed_and_graph_grids():
    for c in C.prefill_cases():
        assert c.num_tokens == 16 * 1024 and c.num_prefills == c.num_seqs and c.timing == "events"
    assert {c.head_size for c in C.prefill_cases()} == {64, 128, 256}
    assert {c.block_size for c in C.prefill_cases()} == {0, 16}
    assert all(max(c.seq_lens) == 128 * 1024 and c.num_seqs <= 2 for c in C.long_cases())
    assert all(c.seqs[0][0] > 0 and c.max_query_len > 1 for c in C.chunked_cases())
    issue_mix = C.mixed_cases()[0]
    assert issue_mix.seqs[0] == (2048, 2048) and issue_mix.seqs[1:] == ((2047, 1),) * 64
    for c in C.mixed_cases():  # prefills first, as the contract wants
        kinds = [q > 1 or ctx == 0 for ctx, q in c.seqs]
        assert kinds == sorted(kinds, reverse=True) and 0 < c.num_prefills < c.num_seqs
    g = C.graph_cases()[0]
    assert (g.num_seqs, g.seq_lens, g.timing) == (1, [1024], "step")


def test_select_refuses_unknown_grids():
    with pytest.raises(ValueError, match="expected grids among"):
        C.select(["decode", "nope"])


def test_skewed_lengths_are_seeded_and_skewed():
    a = C.skewed_lengths(256, mean=2048, max_len=32768, seed=3)
    assert a == C.skewed_lengths(256, mean=2048, max_len=32768, seed=3)
    assert a != C.skewed_lengths(256, mean=2048, max_len=32768, seed=4)
    assert min(a) >= 16 and max(a) <= 32768
    median = sorted(a)[len(a) // 2]
    assert max(a) > 4 * median and 1000 < sum(a) / len(a) < 3000


# ----------------------------------------------------------------------------- floors


def test_visible_pairs_match_counting_every_pair():
    rng = random.Random(0)
    for _ in range(300):
        c, q = rng.randint(0, 60), rng.randint(1, 40)
        w = rng.choice([None, 1, 2, 5, 17, 64, 200])
        brute = sum(1 for i in range(q) for k in range(c + i + 1) if w is None or k > c + i - w)
        assert visible_pairs(c, q, w) == brute, (c, q, w)
        seen = {k for i in range(q) for k in range(c + i + 1) if w is None or k > c + i - w}
        assert keys_read(c, q, w) == len(seen), (c, q, w)


def test_decode_floor_counts_kv_at_its_element_size():
    bf16 = C.Case("decode", "x", ((4095, 1),) * 64)
    wk = work(bf16)
    kv = 64 * 4096 * 8 * 128 * 2 * 2
    assert wk.kv_bytes == kv
    assert wk.bytes == kv + 2 * 64 * 32 * 128 * 2
    assert wk.flops == 4 * 32 * 128 * 64 * 4096
    fp8 = C.Case("decode", "y", bf16.seqs, kv_dtype="fp8_e4m3")
    assert work(fp8).kv_bytes == kv // 2 and work(fp8).flops == wk.flops
    window = C.Case("decode", "z", bf16.seqs, sliding_window=128)
    assert work(window).kv_bytes == kv * 128 // 4096


def test_causal_prefill_floor_counts_visible_pairs_only():
    c = C.Case("prefill", "p", ((0, 4096),) * 4)
    assert work(c).flops == 4 * 32 * 128 * 4 * 4096 * 4097 // 2
    chunk = C.Case("chunked", "c", ((4096, 2048),))
    assert work(chunk).pairs == 2048 * 4096 + 2048 * 2049 // 2


# ----------------------------------------------------------------------------- report


def _fake_rows():
    case = C.decode_cases()[0]
    prefill = C.prefill_cases()[0]
    rows = [make_row(case, work(case), CEILINGS, "raw", "raw", time_us=12.5, speed_vs_flashinfer=0.9,
                     rel_l2=3e-3, rel_l2_ref="flashinfer-raw", store="store_kv", how="graph"),
            make_row(case, work(case), CEILINGS, "triton", "contract", time_us=14.0, rel_l2=float("nan"),
                     store="impl.forward"),
            make_row(case, work(case), CEILINGS, "flashinfer-raw", "peer", skipped="not applicable: absent"),
            make_row(prefill, work(prefill), CEILINGS, "sdpa-cudnn", "dense", time_us=400.0)]
    return rows


def test_rows_derive_rates_bound_and_percent_of_ceiling():
    decode, _, skipped, prefill = _fake_rows()
    assert decode["bound"] == "memory"
    assert decode["gbs"] == pytest.approx(work(C.decode_cases()[0]).bytes / 12.5e3, abs=0.1)
    assert decode["pct_of_ceiling"] == pytest.approx(100 * decode["gbs"] / 3000, abs=0.1)
    assert prefill["bound"] == "compute"
    assert prefill["pct_of_ceiling"] == pytest.approx(100 * prefill["tflops"] / 800, abs=0.1)
    assert "gbs" not in skipped and skipped["skipped"].startswith("not applicable")


def test_report_files_from_fake_rows(tmp_path):
    rows = _fake_rows()
    smi = [{"clocks.sm": "1980 MHz", "clocks.mem": "2619 MHz", "clocks.max.sm": "1980 MHz"}]
    report = dict(environment=dict(gpu="Fake GPU", torch="x", triton="y", flashinfer=None, nvidia_smi=smi),
                  ceilings=CEILINGS, arguments=["--quick"], unavailable=["xformers: not here"],
                  providers=["raw", "triton"], rows=rows)
    paths = write_all(tmp_path / "out", report)
    loaded = json.loads(paths["results.json"].read_text())  # strict JSON: NaN written as a string
    assert loaded["rows"][1]["rel_l2"] == "nan" and loaded["ceilings"] == CEILINGS
    with paths["results.csv"].open() as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == ROW_FIELDS + ENV_FIELDS
        read = list(reader)
    assert [r["provider"] for r in read] == ["raw", "triton", "flashinfer-raw", "sdpa-cudnn"]
    assert {(r["gpu"], r["sm_clock"], r["mem_clock"]) for r in read} == {("Fake GPU", "1980 MHz", "2619 MHz")}
    assert paths["roofline.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = markdown(report)
    assert "| nan |" in md and "not applicable: absent" in md and "Not run: xformers" in md
    assert md == paths["results.md"].read_text()


# ----------------------------------------------------------------------------- command line


def test_arguments_select_cases_and_providers():
    args = parse_args(["--grid", "decode", "--quick", "--match", "window", "--backend", "raw,sdpa"], "p")
    assert [c.name for c in args.cases] == ["decode 32/8/128 B=16 L=4k window 128"]
    assert args.providers == ["raw", "sdpa"]
    assert len(parse_args(["--grid", "prefill,mixed"], "p").cases) == 18 + 3
    assert parse_args(["--splits", "16,1, 4,16"], "p").splits == [1, 4, 16]
    assert parse_args(["--tiles", "64x4x3,128X8x2"], "p").tiles == [(64, 4, 3, None), (128, 8, 2, None)]
    assert parse_args(["--tiles", "128x128x8x3"], "p").tiles == [(128, 8, 3, 128)]


def test_forced_tiles_name_their_rows():
    assert [tile_label(parse_tile(t)) for t in ("64x4x3", "128x128x8x3", "64x32x4x2")] == [
        "n64w4s3", "m128n128w8s3", "m64n32w4s2"]


@pytest.mark.parametrize("argv", [["--backend", "nope"], ["--grid", "nope"], ["--match", "no such case"],
                                  ["--splits", "4,x"], ["--splits", "0"], ["--tiles", "64x4"],
                                  ["--tiles", "64xfourx3"], ["--tiles", "1x2x3x4x5"], ["--tiles", "64x4x3t"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, "p")
    assert exc.value.code == 2 and "expected" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--quick"], "pagedattn bench kernels")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "needs a CUDA device" in err


# ----------------------------------------------------------------------------- the step itself


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("opts", [{}, dict(sliding_window=6, soft_cap=20.0, alibi=True)])
def test_workload_through_the_torch_backend_matches_the_oracle(kv_dtype, opts):
    """The tables, slots, stored step K/V and scales the bench hands every provider describe
    the step the oracle computes (the torch backend is the contract's definition)."""
    from pagedattn.benchmarks.kernels.contract import prepare_contract
    from pagedattn.benchmarks.kernels.workload import make_workload

    case = C.Case("mixed", "tiny", ((0, 7), (9, 3), (20, 1), (33, 1)), num_heads=4, num_kv_heads=2,
                  head_size=16, block_size=4, kv_dtype=kv_dtype, **opts)
    w = make_workload(case, torch.device("cpu"), num_sets=2)
    step = prepare_contract("torch", w, graph=False)
    assert len(step.calls) == 2 and step.store == "impl.forward"
    step.calls[1]()
    step.calls[0]()
    out = step.output().double()
    s, scale = w.sets[0], w.scale_value
    slopes = w.alibi_slopes.tolist() if case.alibi else None
    start = 0
    for (ctx, q), table in zip(case.seqs, w.tables):
        n = ctx + q
        k, v = (s.cache[i][torch.tensor(table)].flatten(0, 1)[:n].double() * scale for i in (0, 1))
        ref = dense_attention(s.query[start:start + q], k, v, scale=w.scale, sliding_window=case.sliding_window,
                              logits_soft_cap=case.soft_cap, alibi_slopes=slopes)
        assert rel_l2(out[start:start + q], ref) < (2e-2 if case.fp8 else 1e-2)
        # the step's own K/V sit at their slots, as every provider's store leaves them
        new_k = k[ctx:] / scale
        expect = s.key[start:start + q].double() if not case.fp8 else (s.key[start:start + q].float() / scale).to(
            w.kv_dtype).double()
        assert torch.equal(new_k, expect)
        start += q
    assert math.isfinite(float(out.sum()))


def test_dense_copies_hold_the_paged_keys():
    from pagedattn.benchmarks.kernels.workload import make_workload

    case = C.Case("decode", "d", ((10, 1),) * 3, num_heads=4, num_kv_heads=2, head_size=16, block_size=4)
    w = make_workload(case, torch.device("cpu"), num_sets=1)
    q, k, v = w.dense()
    assert q.shape == (3, 4, 1, 16) and k.shape == v.shape == (3, 2, 11, 16)
    for b, table in enumerate(w.tables):
        keys = w.sets[0].cache[0][torch.tensor(table)].flatten(0, 1)[:11]
        assert torch.equal(k[b].transpose(0, 1), keys)
    assert pagedattn.ScheduledSeq(11, 1, w.tables[0]) == w.scheduled()[0]


def test_graph_metadata_route_gives_the_eager_answer():
    """Decode cases run the contract on capture metadata holding the real step (API.md section
    5); called eagerly here, it must give what metadata from `builder.build` gives."""
    from pagedattn.benchmarks.kernels.contract import prepare_contract
    from pagedattn.benchmarks.kernels.workload import make_workload

    case = C.Case("decode", "g", ((9, 1), (30, 1), (4, 1)), num_heads=4, num_kv_heads=2, head_size=16,
                  block_size=4, timing="graph")
    w = make_workload(case, torch.device("cpu"), num_sets=1)
    outs = []
    for graph in (False, True):
        step = prepare_contract("torch", w, graph=graph)
        assert not step.eager_only, step.note
        w.sets[0].out.fill_(float("nan"))
        step.calls[0]()
        outs.append(step.output().clone())
    assert torch.equal(outs[0], outs[1])
