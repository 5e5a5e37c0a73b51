"""The metadata builder: fields, dtypes and values of API.md section 2, the prefill/decode
views, CUDA-graph padding and sliding-window table trimming."""

import math

import pytest
import torch

from cases import KERNEL_GRID, Shape, make_scenario, shapes
from oracle import tolerance_for

MIXED = shapes("mixed")[0]


def _cpu_list(t):
    return t.cpu().tolist()


def _check_tensor(md, name, dtype, shape, device):
    t = getattr(md, name)
    assert isinstance(t, torch.Tensor), f"{name}: expected a tensor, got {type(t).__name__}"
    assert t.dtype == dtype, f"{name}: expected {dtype}, got {t.dtype}"
    assert tuple(t.shape) == tuple(shape), f"{name}: expected shape {shape}, got {tuple(t.shape)}"
    assert t.device.type == device.type, f"{name}: expected on {device}, got {t.device}"
    return t


@pytest.mark.parametrize("shape", shapes("mixed", "block_boundaries", "many_decodes",
                                         "long_prefill", "block_size_1"), ids=str)
def test_fields(backend, device, model_dtype, shape):
    sc = make_scenario(backend, shape, device=device, dtype=model_dtype, seed=50)
    md = sc.build()
    lens = shape.lens
    b, t = len(lens), sc.num_tokens
    prefills = [(c, q) for c, q in lens if q > 1 or c == 0]
    decodes = lens[len(prefills):]
    assert md.num_prefills == len(prefills)
    assert md.num_prefill_tokens == sum(q for _, q in prefills)
    assert md.num_decode_tokens == len(decodes)
    assert md.use_cuda_graph is False
    seq_lens = [c + q for c, q in lens]
    assert list(md.seq_lens) == seq_lens

    slots = _check_tensor(md, "slot_mapping", torch.int64, (t,), device)
    assert _cpu_list(slots) == sc.step_slots(), "slot_mapping differs from the block tables"
    assert _cpu_list(_check_tensor(md, "seq_lens_tensor", torch.int32, (b,), device)) == seq_lens
    assert _cpu_list(_check_tensor(md, "context_lens_tensor", torch.int32, (b,), device)) == [
        c for c, _ in lens]
    qsl = _check_tensor(md, "query_start_loc", torch.int32, (b + 1,), device)
    assert _cpu_list(qsl) == [0] + list(torch.tensor([q for _, q in lens]).cumsum(0).tolist())
    ssl = _check_tensor(md, "seq_start_loc", torch.int32, (b + 1,), device)
    assert _cpu_list(ssl) == [0] + list(torch.tensor(seq_lens).cumsum(0).tolist())

    tables = md.block_tables
    assert tables.dtype == torch.int32 and tables.dim() == 2 and tables.shape[0] == b, (
        f"block_tables: expected int32 [{b}, max_blocks], got {tables.dtype} "
        f"{tuple(tables.shape)}")
    assert tables.device.type == device.type
    rows = _cpu_list(tables)
    for row, table, (c, q) in zip(rows, sc.block_tables, lens):
        if c > 0:  # a sequence that reads cached context needs its table
            n = math.ceil((c + q) / shape.block_size)
            assert row[:n] == table[:n], f"block table row {row} does not start with {table[:n]}"

    assert md.max_query_len == max(q for _, q in lens)
    assert md.max_prefill_seq_len == max([c + q for c, q in prefills], default=0)
    assert md.max_decode_seq_len == max([c + q for c, q in decodes], default=0)


def test_no_padding_slots_without_graphs(backend, device, model_dtype):
    sc = make_scenario(backend, MIXED, device=device, dtype=model_dtype, seed=51)
    assert bool((sc.build().slot_mapping >= 0).all())


def test_prefill_and_decode_views(backend, device, model_dtype):
    sc = make_scenario(backend, MIXED, device=device, dtype=model_dtype, seed=52)
    md = sc.build()
    pre, dec = md.prefill_metadata, md.decode_metadata
    assert pre is not None and dec is not None
    assert md.prefill_metadata is pre and md.decode_metadata is dec, "views must be cached"
    n_pre = md.num_prefills
    npt = md.num_prefill_tokens
    assert pre.num_prefills == n_pre and pre.num_decode_tokens == 0
    assert pre.num_prefill_tokens == npt
    assert _cpu_list(pre.slot_mapping) == sc.step_slots()[:npt]
    assert _cpu_list(pre.seq_lens_tensor) == list(md.seq_lens)[:n_pre]
    assert dec.num_prefills == 0 and dec.num_prefill_tokens == 0
    assert dec.num_decode_tokens == md.num_decode_tokens
    assert _cpu_list(dec.slot_mapping) == sc.step_slots()[npt:]
    assert _cpu_list(dec.seq_lens_tensor) == list(md.seq_lens)[n_pre:]


@pytest.mark.parametrize("name,empty", [("many_decodes", "prefill"), ("long_prefill", "decode")])
def test_empty_view_is_none(backend, device, model_dtype, name, empty):
    md = make_scenario(backend, shapes(name)[0], device=device, dtype=model_dtype, seed=53).build()
    assert getattr(md, f"{empty}_metadata") is None
    other = "decode" if empty == "prefill" else "prefill"
    view = getattr(md, f"{other}_metadata")
    assert view is not None and getattr(md, f"{other}_metadata") is view


@pytest.mark.parametrize("pad_to", [8, 4])
def test_cuda_graph_padding(backend, device, model_dtype, pad_to):
    shape = Shape("three_decodes", ((9, 1), (16, 1), (40, 1)))
    sc = make_scenario(backend, shape, device=device, dtype=model_dtype, seed=54)
    md = sc.build(pad_to=pad_to)
    assert md.use_cuda_graph is True
    slots = _cpu_list(md.slot_mapping)
    assert len(slots) == pad_to
    assert slots[:3] == sc.step_slots() and slots[3:] == [-1] * (pad_to - 3)
    assert md.seq_lens_tensor.shape[0] == pad_to and md.block_tables.shape[0] == pad_to
    assert md.num_prefills == 0 and md.num_decode_tokens == pad_to
    assert _cpu_list(md.seq_lens_tensor)[:3] == [10, 17, 41]

    # padded rows compute something, write nothing; real rows are exact
    extra = pad_to - 3
    def pad(x):  # [3, H, D] -> [pad_to, H, D], random rows below
        return torch.cat([x, torch.randn(extra, *x.shape[1:], device=device).to(x.dtype)])

    q, k, v = pad(sc.query), pad(sc.key), pad(sc.value)
    out = sc.forward(sc.impl(), md, query=q, key=k, value=v)
    assert out.shape[0] == pad_to
    sc.check(out[:3])
    sc.check_cache_writes()


@pytest.mark.parametrize("window,shape", [
    (20, Shape("window_trim", ((0, 50), (40, 30), (70, 1), (33, 1), (5, 1)), block_size=4)),
    (7, Shape("window_trim_bs1", ((30, 4), (25, 1)), block_size=1)),
    pytest.param(16, shapes("chunked_prefill")[0], marks=KERNEL_GRID),  # the trims above, at 700 keys
])
def test_sliding_window_trimming_keeps_results(backend, device, model_dtype, window, shape):
    """A builder told the window may drop blocks wholly outside it; the answer must not move."""
    sc = make_scenario(backend, shape, device=device, dtype=model_dtype, seed=55)
    trimmed = sc.run(builder_window=window, sliding_window=window)
    sc.check(trimmed, sliding_window=window)
    sc.reset_cache()
    full = sc.run(sliding_window=window)
    # Same keys, other tile boundaries: equal up to one rounding of the output dtype.
    tol = max(tolerance_for(sc.dtype).atol / 5, 2 * torch.finfo(sc.dtype).eps)
    torch.testing.assert_close(trimmed, full, atol=tol, rtol=tol)
