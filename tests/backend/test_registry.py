"""The backend registry: names, availability with reasons, "auto" and PAGEDATTN_BACKEND."""

import pytest

import pagedattn

NAMES = {"torch", "triton", "flash_attn", "flashinfer", "xformers"}


def test_list_backends_names_and_reasons():
    statuses = pagedattn.list_backends()
    by_name = {s.name: s for s in statuses}
    assert NAMES <= set(by_name), f"expected {sorted(NAMES)}, got {sorted(by_name)}"
    for s in statuses:
        assert isinstance(s.available, bool)
        assert isinstance(s.reasons, list) and all(isinstance(r, str) for r in s.reasons)
        if not s.available:
            assert s.reasons, f"{s.name} is unavailable but gives no reason"
    assert by_name["torch"].available, "the torch backend runs everywhere"


def test_get_backend_returns_a_backend_class():
    b = pagedattn.get_backend("torch")
    assert isinstance(b.get_name(), str)
    for method in ("get_impl_cls", "get_metadata_cls", "get_builder_cls", "get_state_cls"):
        assert isinstance(getattr(b, method)(), type), method
    assert isinstance(b.get_supported_head_sizes(), list)
    assert pagedattn.get_backend("torch") is b


def test_auto():
    b = pagedattn.get_backend("auto")
    assert isinstance(b.get_name(), str)
    assert pagedattn.get_backend() is b


def test_env_overrides_auto(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_BACKEND", "torch")
    assert pagedattn.get_backend("auto") is pagedattn.get_backend("torch")


def test_env_naming_an_unknown_backend_raises(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_BACKEND", "nope")
    with pytest.raises(pagedattn.BackendUnavailableError):
        pagedattn.get_backend("auto")


def test_unknown_name_lists_valid_names():
    with pytest.raises(pagedattn.BackendUnavailableError) as info:
        pagedattn.get_backend("nope")
    msg = str(info.value)
    for name in NAMES:
        assert name in msg, f"the error should list {name!r}: {msg}"


def test_unavailable_backend_says_why():
    for s in pagedattn.list_backends():
        if not s.available:
            with pytest.raises(pagedattn.BackendUnavailableError) as info:
                pagedattn.get_backend(s.name)
            assert any(r in str(info.value) for r in s.reasons), str(info.value)
            return
    pytest.skip("every backend is available here")
