"""The backend registry: names, lazy imports, availability with reasons, and "auto"."""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedattn.attention.backend import AttentionBackend

ENV_VAR = "PAGEDATTN_BACKEND"


class BackendUnavailableError(RuntimeError):
    """An unknown backend name, or one that cannot run here; the message says why."""


@dataclass(frozen=True)
class BackendStatus:
    name: str
    available: bool
    reasons: list[str] = field(default_factory=list)
    provider: str = ""


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _missing(module: str, extra: str) -> list[str]:
    if importlib.util.find_spec(module) is None:
        return [f"{module} is not installed (pip install 'pagedattn[{extra}]')"]
    return []


def _torch_reasons() -> list[str]:
    return []


def _not_yet(issue: str) -> Callable[[], list[str]]:
    return lambda: [f"not implemented yet ({issue})"]


@dataclass(frozen=True)
class _Entry:
    module: str
    cls: str
    reasons: Callable[[], list[str]]


_REGISTRY: dict[str, _Entry] = {
    "torch": _Entry("pagedattn.backends.torch_backend", "TorchBackend", _torch_reasons),
    "triton": _Entry("pagedattn.backends.triton_backend", "TritonBackend", _not_yet("the Triton kernels issue")),
    "flash_attn": _Entry("pagedattn.backends.flash_attn_backend", "FlashAttnBackend", _not_yet("the flash_attn issue")),
    "flashinfer": _Entry("pagedattn.backends.flashinfer_backend", "FlashInferBackend", _not_yet("the FlashInfer issue")),
    "xformers": _Entry("pagedattn.backends.xformers_backend", "XFormersBackend", _not_yet("the xFormers issue")),
}
# "auto" takes the first available of these for the device.
_AUTO_ORDER = {"cuda": ("triton", "flashinfer", "torch"), "cpu": ("torch",)}


def backend_names() -> list[str]:
    return list(_REGISTRY)


def list_backends() -> list[BackendStatus]:
    """Every registered backend with its availability here and the reasons when not."""
    out = []
    for name, entry in _REGISTRY.items():
        reasons = entry.reasons()
        out.append(BackendStatus(name, not reasons, reasons, _provider(name) if not reasons else ""))
    return out


def _provider(name: str) -> str:
    cls = _load(name)
    return getattr(cls, "provider", lambda: name)()


def _load(name: str) -> type[AttentionBackend]:
    entry = _REGISTRY[name]
    return getattr(importlib.import_module(entry.module), entry.cls)


def _unavailable(name: str, reasons: list[str]) -> BackendUnavailableError:
    valid = ", ".join(["auto", *_REGISTRY])
    why = "; ".join(reasons)
    return BackendUnavailableError(f"backend {name!r} cannot run: {why}. Valid names: {valid}")


def get_backend(name: str = "auto") -> type[AttentionBackend]:
    """The backend class registered under `name`; "auto" picks the best available for the device
    (CUDA if present), unless the environment variable PAGEDATTN_BACKEND names one."""
    if name == "auto":
        forced = os.environ.get(ENV_VAR)
        if forced:
            return get_backend(forced)
        device = "cuda" if _cuda() else "cpu"
        for candidate in _AUTO_ORDER[device]:
            if not _REGISTRY[candidate].reasons():
                return _load(candidate)
        raise _unavailable(name, [f"no backend is available on {device}"])
    if name not in _REGISTRY:
        raise _unavailable(name, ["unknown name"])
    reasons = _REGISTRY[name].reasons()
    if reasons:
        raise _unavailable(name, reasons)
    return _load(name)
