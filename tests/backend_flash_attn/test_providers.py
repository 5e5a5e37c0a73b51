"""Which provider the flash_attn backend runs on, and what it then refuses: selection (the fake
FA4 standing in for `flash_attn.cute`), pinning through PAGEDATTN_FLASH_ATTN_PROVIDER, the
fallback to our interface, refusals at construction with the provider's reason, and one mixed
step through the backend on the fake FA4 against the torch backend."""

from __future__ import annotations

import pytest
import torch

import fake_fa4
import pagedattn
from oracle import assert_attention_close, tolerance_for
from pagedattn.backends import flash_attn_backend, flash_attn_providers as providers

BACKEND = flash_attn_backend.FlashAttnBackend


def test_nothing_installed_falls_back_to_our_interface(nothing_installed, on_gpu):
    choice = providers.choose("cuda")
    assert choice.provider.name == "ours"
    assert choice.provider.api is pagedattn.flash_attn_interface
    assert choice.why_not == {"fa3": "flash_attn_interface not installed", "fa4": "flash_attn.cute not installed",
                              "fa2": "flash_attn.flash_attn_interface not installed"}
    assert "FA4: flash_attn.cute not installed" in choice.describe()


def test_on_the_cpu_nothing_is_imported(fake_fa4_installed, monkeypatch):
    monkeypatch.setattr(providers, "_LOADERS", None)  # loading any would fail
    choice = providers.choose("cpu")
    assert choice.provider.name == "ours"
    assert choice.why_not["fa4"] == "installed, but runs on CUDA only (tensors on cpu)"


def test_fa4_runs_on_an_h100(fake_fa4_installed, on_gpu):
    choice = providers.choose("cuda")
    assert choice.provider.name == "fa4", choice.describe()
    caps = choice.provider.capabilities
    assert caps.dtypes == (torch.float16, torch.bfloat16) and caps.kv_cache_dtypes == ("auto",)
    assert not caps.alibi and caps.head_sizes == tuple(range(8, 257, 8))
    assert "warm-up" in choice.provider.cuda_graphs
    assert fake_fa4.calls, "expected the smoke test to have called FA4"
    assert choice.describe().startswith("FA4 ")


def test_fa4_head_sizes_on_blackwell(fake_fa4_installed, on_gpu):
    on_gpu.arch = (10, 0)
    assert providers.choose("cuda").provider.capabilities.head_sizes == tuple(range(8, 129, 8)) + (256,)


def test_fa4_without_a_paged_path_is_not_chosen(fake_fa4_installed, on_gpu):
    on_gpu.arch = (8, 0)
    choice = providers.choose("cuda")
    assert choice.provider.name == "ours"
    assert "no paged KV cache on SM 8.x" in choice.why_not["fa4"]


def test_fa4_that_disagrees_is_not_chosen(fake_fa4_installed, on_gpu, monkeypatch):
    monkeypatch.setattr(fake_fa4_installed, "flash_attn_varlen_func",
                        lambda *a, **k: (lambda o, lse: (o * 2 + 1, lse))(*fake_fa4.flash_attn_varlen_func(*a, **k)))
    choice = providers.choose("cuda")
    assert choice.provider.name == "ours"
    assert "disagrees with a dense reference" in choice.why_not["fa4"]


def test_pin_ours_keeps_our_interface_where_fa4_runs(fake_fa4_installed, on_gpu, monkeypatch):
    monkeypatch.setenv(providers.ENV_VAR, "ours")
    choice = providers.choose("cuda")
    assert choice.provider.name == "ours" and choice.pinned == "ours"
    assert not fake_fa4.calls, "a pin on ours must not load FA4"


def test_pin_fa4_where_it_does_not_run_is_an_error(nothing_installed, monkeypatch):
    monkeypatch.setenv(providers.ENV_VAR, "fa4")
    with pytest.raises(providers.ProviderUnavailableError, match="flash_attn.cute not installed"):
        providers.require("cpu")
    assert any(providers.ENV_VAR in r for r in flash_attn_backend.unavailable_reasons())


def test_a_bad_pin_says_what_was_expected(monkeypatch):
    monkeypatch.setenv(providers.ENV_VAR, "fa5")
    with pytest.raises(providers.ProviderUnavailableError, match="expected one of ours, fa3, fa4, fa2, got 'fa5'"):
        providers.require("cpu")


# ----------------------------------------------------------------------------- the backend on FA4


@pytest.fixture
def backend_on_fa4(fake_fa4_installed, on_gpu, monkeypatch):
    """The flash_attn backend as on an H100 with FA4, its calls on CPU tensors going to FA4 too."""
    provider = providers.choose("cuda").provider
    assert provider.name == "fa4"
    monkeypatch.setattr(providers, "machine_device_type", lambda: "cuda")
    monkeypatch.setattr(providers, "require", lambda device_type: provider)
    return provider


REFUSED = {
    "fp8": (dict(kv_cache_dtype="fp8"), "kv_cache_dtype='fp8'"),
    "alibi": (dict(alibi_slopes=[0.1] * 4), "alibi_slopes (FA4 takes no ALiBi slopes)"),
    "head_size": (dict(head_size=264), "head_size=264"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refusals_at_construction_name_the_provider(backend_on_fa4, case):
    change, what = REFUSED[case]
    args = dict(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2) | change
    with pytest.raises(NotImplementedError) as e:
        BACKEND.get_impl_cls()(**args)
    assert what in str(e.value) and "FA4" in str(e.value) and providers.ENV_VAR in str(e.value)


def test_float32_is_refused(backend_on_fa4):
    impl = BACKEND.get_impl_cls()(4, 64, 0.125, 2)
    with pytest.raises(TypeError, match="float32"):
        impl.set_query_dtype(torch.float32)


def test_block_sizes_the_provider_lacks_are_refused(backend_on_fa4, monkeypatch):
    fa2_like = providers.Provider("fa2", "FA2 2.8.3", None, backend_on_fa4.capabilities, block_size_multiple=256)
    monkeypatch.setattr(providers, "require", lambda device_type: fa2_like)
    with pytest.raises(NotImplementedError, match="multiple of 256, got 16"):
        BACKEND.get_builder_cls()(16, "cpu")
    BACKEND.get_builder_cls()(512, "cpu")


def test_a_mixed_step_on_fa4_matches_the_torch_backend(backend_on_fa4, device):
    """Fresh prompt, chunk over a cached prefix, decodes: through FA4 (the fake) and torch, on
    the suite's device (the store is a Triton kernel: CUDA tensors where CUDA runs it)."""
    seqs = [pagedattn.ScheduledSeq(20, 20, [4, 1]), pagedattn.ScheduledSeq(40, 8, [0, 2, 5]),
            pagedattn.ScheduledSeq(18, 1, [3, 6]), pagedattn.ScheduledSeq(9, 1, [7])]
    hq, hkv, d, bs, dtype = 4, 2, 64, 16, torch.bfloat16
    g = torch.Generator().manual_seed(0)
    t = 20 + 8 + 1 + 1
    q = torch.randn(t, hq * d, generator=g).to(device, dtype)
    k, v = (torch.randn(t, hkv * d, generator=g).to(device, dtype) for _ in range(2))
    cache0 = torch.randn(2, 8, bs, hkv, d, generator=g).to(device, dtype)  # prefixes already cached
    outs = {}
    for name in ("flash_attn", "torch"):
        backend = pagedattn.get_backend(name)
        md = backend.get_builder_cls()(bs, device).build(seqs)
        impl = backend.get_impl_cls()(hq, d, d ** -0.5, hkv, sliding_window=24, logits_soft_cap=30.0)
        cache = cache0.clone().view(backend.get_kv_cache_shape(8, bs, hkv, d))
        outs[name] = impl.forward(q, k, v, cache, md)
    groups = [(0, 20), (20, 28), (28, 29), (29, 30)]
    assert_attention_close(outs["flash_attn"].view(t, hq, d), outs["torch"].view(t, hq, d).double().cpu(),
                           tolerance_for(dtype), groups)
    assert [c["q_shape"] for c in fake_fa4.calls[-2:]] == [(28, hq, d), (2, 1, hq, d)], "prefill part, decode part"
    assert fake_fa4.calls[-2]["page_table"] is not None, "a chunk over a cached prefix reads the pages"
    assert BACKEND.provider().startswith("FA4 ")
