"""Whose build of xFormers' fmha the `xformers` backend calls here, and which operators of it run.

Two packages ship xFormers' attention operators and biases under the same names: xFormers
itself (`xformers.ops.fmha`) and MSLK (`mslk.attention.fmha`), which xFormers' releases since
2026-04 re-export. Where xFormers' own CUDA extension does not load (xFormers 0.0.35 is built for
torch 2.10 + CUDA 12.8 and Python 3.10; the GPU machine has torch 2.11 + CUDA 13 and Python
3.12), MSLK's wheel for torch 2.11 + CUDA 13 (`mslk-cuda==1.1.0`) runs them.

An operator accepts only its own module's bias classes, so the backend uses one module for
everything: the first of SOURCES in which some operator runs on the device.
PAGEDATTN_XFORMERS_PROVIDER=xformers|mslk|ours pins one (a pinned module that does not run is an
error; "ours" runs every part on our kernels). Operators by role, each tried in this order:
- "step": attention over the step's own K/V (fresh prompts, encoder, encoder-only, cross over
  the step's encoder rows): `flash3` (FA3), `flash` (FA2), `cutlass`; a call takes the first
  whose `not_supported_reasons` accept its inputs (a tensor bias for ALiBi: cutlass only);
- "paged": attention through the block tables (chunks over a prefix, decodes, cross attention
  over the cache): `triton_splitk`, the one paged operator (MSLK's FA3 split-KV is not built
  in 1.1.0).
An operator is used only after it ran one tiny case on the device and agreed with a dense
reference (`smoke_test`): an operator can load and still fail to run (xFormers 0.0.35's
cutlassF-pt and triton_splitKF load on the H100 and then refuse: "xFormers wasn't built with CUDA
support").
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass, field
from types import ModuleType

import torch

from pagedattn.attention import registry

SOURCES = {"xformers": "xformers.ops.fmha", "mslk": "mslk.attention.fmha"}
DISTRIBUTIONS = {"xformers": "xformers", "mslk": "mslk-cuda"}
ROLES = {"step": ("flash3", "flash", "cutlass"), "paged": ("triton_splitk",)}
WHERE = {"step": "over the step's K/V", "paged": "over the paged cache"}
ENV_VAR = registry.PROVIDER_ENV_VARS["xformers"]


class ProviderUnavailableError(RuntimeError):
    """The fmha module pinned by PAGEDATTN_XFORMERS_PROVIDER cannot run here."""


@dataclass(frozen=True)
class Fmha:
    """The fmha module chosen for a device type (None: our kernels run every part), the
    operators of it that run, per role in order of preference, and why the others do not."""

    module: ModuleType | None
    name: str = "ours"  # "xformers", "mslk" or "ours"
    ops: dict[str, tuple[type, ...]] = field(default_factory=dict)  # role -> runnable FwOps
    why_not: dict[str, str] = field(default_factory=dict)  # "<source> <role or op>" -> reason
    pinned: bool = False

    def runs(self, role: str) -> bool:
        return bool(self.ops.get(role))

    def describe(self) -> str:
        pin = f" (pinned by {ENV_VAR})" if self.pinned else ""
        not_run = "; ".join(f"{k}: {w}" for k, w in self.why_not.items())
        if self.module is None:
            return f"pagedattn.kernels (our Triton kernels) for every part{pin}" + (f": {not_run}" if not_run else "")
        version = _version(DISTRIBUTIONS[self.name])
        used = "; ".join(f"{', '.join(op.NAME for op in ops)} {WHERE[role]}" for role, ops in self.ops.items() if ops)
        return (f"xFormers fmha from {SOURCES[self.name]} ({DISTRIBUTIONS[self.name]} {version}){pin}: {used}, "
                f"for the calls they take; pagedattn.kernels for the rest" + (f" ({not_run})" if not_run else ""))


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


@functools.cache
def choose(device_type: str) -> Fmha:
    """The fmha module and operators the backend uses on devices of `device_type`."""
    pin = registry.pinned_provider("xformers")
    if pin is not None and pin not in (*SOURCES, "ours"):
        raise ProviderUnavailableError(f"{ENV_VAR}={pin}: expected one of {', '.join([*SOURCES, 'ours'])}")
    if pin == "ours":
        return Fmha(None, pinned=True)
    why_not: dict[str, str] = {}
    for name in ([pin] if pin else SOURCES):
        module, why = _import(name, device_type)
        if module is None:
            why_not[name] = why
            continue
        ops, refused = _runnable_ops(module, device_type)
        why_not.update({f"{name} {op_name}": w for op_name, w in refused.items()})
        if any(ops.values()):
            return Fmha(module, name, ops, why_not, pinned=pin is not None)
    if pin:
        raise ProviderUnavailableError(f"{ENV_VAR}={pin} pins an fmha that does not run here: "
                                       + "; ".join(f"{k}: {w}" for k, w in why_not.items()))
    return Fmha(None, why_not=why_not)


def _import(name: str, device_type: str) -> tuple[ModuleType | None, str]:
    top = SOURCES[name].split(".")[0]
    if importlib.util.find_spec(top) is None:
        extra = "pip install 'pagedattn[xformers]'" if name == "xformers" else "pip install mslk-cuda"
        return None, f"not installed ({extra})"
    if device_type != "cuda":
        return None, f"no {device_type} kernels"
    try:
        return importlib.import_module(SOURCES[name]), ""
    except Exception as e:  # noqa: BLE001 - a wheel built for another torch fails in many ways
        return None, f"{SOURCES[name]} does not import: {type(e).__name__}: {e}"


def _runnable_ops(module: ModuleType, device_type: str) -> tuple[dict[str, tuple[type, ...]], dict[str, str]]:
    ops: dict[str, tuple[type, ...]] = {}
    refused: dict[str, str] = {}
    for role, names in ROLES.items():
        runnable = []
        for op_name in names:
            op = getattr(getattr(module, op_name, None), "FwOp", None)
            if op is None:
                refused[op_name] = "not in this build"
                continue
            why = smoke_test(module, op, role, torch.device(device_type)) if op.is_available() else (
                f"{op.NAME} is not built or does not load (XFORMERS_MORE_DETAILS=1 says why)")
            if why:
                refused[op_name] = why
            else:
                runnable.append(op)
        ops[role] = tuple(runnable)
    return ops, refused


def smoke_test(module: ModuleType, op, role: str, device: torch.device) -> str:
    """Run `op` of `module` once on 1 query over 40 keys ("paged": the cache of one 64-slot block)
    on `device` and compare with a dense reference; "" when it agrees, else why not (never
    raises: whatever goes wrong is the operator's reason)."""
    from pagedattn.backends import xformers_bias

    xb = module.attn_bias
    try:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(1, n, 1, 1, 128, device=device, dtype=torch.bfloat16, generator=g)
                   for n in (1, 64, 64))
        if role == "paged":
            table = torch.zeros(1, 1, dtype=torch.int32, device=device)
            bias = xformers_bias.paged(xb, [1], [40], table, 64, causal=True)
        else:
            bias = xformers_bias.block_diagonal(xb, [1], [40], causal=False, sliding_window=None, device=device)
            k, v = k[:, :40], v[:, :40]
        out = module.memory_efficient_attention_forward(q, k, v, attn_bias=bias, scale=0.1, op=op)
    except Exception as e:  # noqa: BLE001 - why it fails is the answer
        detail = " ".join(line.strip() for line in str(e).splitlines() if line.strip())  # its reasons follow line 1
        return f"{op.NAME} loads but does not run here: {type(e).__name__}: {detail[:400]}"
    keys, values = k[0, :40, 0, 0].float(), v[0, :40, 0, 0].float()
    ref = ((q[0, 0, 0, 0].float() @ keys.T) * 0.1).softmax(-1) @ values
    err = ((out.flatten().float() - ref).norm() / ref.norm()).item()
    return "" if err < 2e-2 else f"{op.NAME} runs but disagrees with a dense reference (rel L2 {err:.3g})"
