"""The backend registry: names, lazy imports, availability with reasons, and "auto"."""

from __future__ import annotations

import importlib
import importlib.util
import os
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


@dataclass(frozen=True)
class _Entry:
    module: str
    cls: str

    def reasons(self) -> list[str]:
        """Why this backend cannot run here (empty: it can). Each backend module answers for
        itself through `unavailable_reasons()`, importing no optional dependency to do so."""
        if importlib.util.find_spec(self.module) is None:
            return ["not implemented yet"]
        return importlib.import_module(self.module).unavailable_reasons()


_REGISTRY: dict[str, _Entry] = {
    "torch": _Entry("pagedattn.backends.torch_backend", "TorchBackend"),
    "triton": _Entry("pagedattn.backends.triton_backend", "TritonBackend"),
    "flash_attn": _Entry("pagedattn.backends.flash_attn_backend", "FlashAttnBackend"),
    "flashinfer": _Entry("pagedattn.backends.flashinfer_backend", "FlashInferBackend"),
    "xformers": _Entry("pagedattn.backends.xformers_backend", "XFormersBackend"),
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
    """Which library runs the backend's kernels (a backend named after a library may run ours)."""
    return _load(name).provider()


def _load(name: str) -> type[AttentionBackend]:
    entry = _REGISTRY[name]
    return getattr(importlib.import_module(entry.module), entry.cls)


# backends with a choice of provider
PROVIDER_ENV_VARS = {"flash_attn": "PAGEDATTN_FLASH_ATTN_PROVIDER", "xformers": "PAGEDATTN_XFORMERS_PROVIDER"}


def pinned_provider(backend_name: str) -> str | None:
    """The provider the environment pins for `backend_name` (lower case), or None. The registry
    is the one reader of the environment for backends (STYLE.md)."""
    var = PROVIDER_ENV_VARS.get(backend_name)
    return (os.environ.get(var, "").strip().lower() or None) if var else None


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
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
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
