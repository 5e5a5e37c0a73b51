"""Per-layer hyperparameters and FP8 scales: several layer specs planned for one step (Gemma 2's
alternating windows), real FP8 scales as floats or device tensors, and the float-workspace
bound against FlashInfer's own `workspace_size()`."""

from __future__ import annotations

import pytest
import torch

from cases import make_scenario, shapes
from pagedattn.backends.flashinfer_plan import Role, split_kv_workspace_bytes, workspace

MIXED = shapes("mixed")[0]


def test_alternating_windows_planned_once_per_step(fi, cuda):
    sc = make_scenario(fi, MIXED, head_size=128, dtype=torch.bfloat16, device=cuda, seed=3)
    local = sc.impl(sliding_window=19, logits_soft_cap=5.0, scale=0.2)
    glob = sc.impl(logits_soft_cap=5.0, scale=0.2)
    sc.forward(local, sc.build())  # the first step teaches each layer its query dtype
    sc.reset_cache()
    glob_out = sc.forward(glob, sc.build())
    sc.reset_cache()
    md = sc.build(layers=[local, glob])
    for impl in (local, glob):
        spec = impl.spec(torch.bfloat16)
        assert md.prefill_metadata.plans.get(Role.PREFILL, spec) is not None, "prefill not planned by build"
        assert md.decode_metadata.plans.get(Role.DECODE, spec) is not None, "decode not planned by build"
    out = sc.forward(local, md)
    sc.check(out, sliding_window=19, logits_soft_cap=5.0, scale=0.2)
    sc.reset_cache()
    out_glob = sc.forward(glob, md)
    sc.check(out_glob, logits_soft_cap=5.0, scale=0.2)
    torch.testing.assert_close(out_glob, glob_out, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("shape", shapes("mixed", "chunked_prefill", "many_decodes", "gqa_8to1"), ids=str)
def test_fp8_scales_as_floats_or_tensors(fi, cuda, kv_cache_dtype, shape):
    sc = make_scenario(fi, shape, head_size=128, dtype=torch.bfloat16, device=cuda,
                       kv_cache_dtype=kv_cache_dtype, seed=4)
    assert sc.k_scale != 1.0 and sc.v_scale != 1.0
    as_float = sc.run()
    sc.check(as_float)
    sc.check_cache_writes()
    sc.reset_cache()
    as_tensor = sc.run(scales_as_tensors=True)
    sc.check(as_tensor)
    torch.testing.assert_close(as_tensor.float(), as_float.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("heads", [(32, 8), (8, 8), (64, 8), (16, 1)])
@pytest.mark.parametrize("batch", [1, 7, 64, 300])
def test_workspace_bound_covers_flashinfer(fi, cuda, heads, batch):
    """Our documented bound >= what FlashInfer's plans ask for (decode, tensor-core decode,
    FA2 paged prefill, and a CUDA-graph decode wrapper)."""
    import flashinfer

    hq, hkv, d, bs = *heads, 128, 16
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 4000, (batch,), generator=g).tolist()
    pages = [-(-n // bs) for n in lens]
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * bs for n, p in zip(lens, pages)], dtype=torch.int32)
    indices = torch.arange(int(indptr[-1]), dtype=torch.int32, device=cuda)
    impl = fi.get_impl_cls()(hq, d, 0.1, hkv)
    spec = impl.spec(torch.bfloat16)
    ws = workspace(cuda)
    bound = split_kv_workspace_bytes(spec, ws.num_sm, ws.max_threads_per_sm, 0, ws.smem_per_block_optin)
    buf = torch.zeros(16, dtype=torch.uint8, device=cuda)
    for tc in (True,) if spec.use_tensor_cores else (False, True):  # as the backend picks
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(buf, "NHD", use_tensor_cores=tc)
        need, _ = w.workspace_size(indptr, indices, last, hq, hkv, d, bs, q_data_type=torch.bfloat16)
        assert need <= bound, f"decode (tensor cores={tc}) needs {need} > bound {bound}"
    qo = torch.tensor([0] + torch.tensor([min(n, 200) for n in lens]).cumsum(0).tolist(), dtype=torch.int32)
    pw = flashinfer.BatchPrefillWithPagedKVCacheWrapper(buf, "NHD", backend="fa2")
    need, _ = pw.workspace_size(qo, indptr, indices, last, hq, hkv, d, bs, causal=True, q_data_type=torch.bfloat16)
    assert need <= bound, f"fa2 prefill needs {need} > bound {bound}"
    if spec.use_tensor_cores and batch <= 64:
        graph_bound = split_kv_workspace_bytes(spec, ws.num_sm, ws.max_threads_per_sm, batch, ws.smem_per_block_optin)
        bufs = dict(paged_kv_indptr_buffer=indptr.to(cuda), paged_kv_indices_buffer=indices,
                    paged_kv_last_page_len_buffer=last.to(cuda))
        gw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(buf, "NHD", use_cuda_graph=True, use_tensor_cores=True, **bufs)
        need, _ = gw.workspace_size(indptr, indices, last, hq, hkv, d, bs, q_data_type=torch.bfloat16)
        assert need <= graph_bound, f"graph decode needs {need} > bound {graph_bound}"
