"""The providers of the `flash_attn` backend: whose FlashAttention runs it on a device.

A provider exposes FlashAttention 2's two paged entry points as the backend calls them
(`api.flash_attn_varlen_func(..., block_table=, out=)` and `api.flash_attn_with_kvcache(...,
out=)`, FP8 descales as keyword-only `k_descale`/`v_descale`, attention sinks as FA4's
keyword-only `learnable_sink`) and its limits as data (`capabilities`, `block_size_multiple`,
`cuda_graphs`).

Dao-AILab's builds are tried in this order on CUDA, the first that imports and runs one tiny
paged decode against a dense reference (`smoke_test`) wins:
1. "fa3", FA3 (`flash_attn_interface`, the hopper build): Hopper only, its maintainers' fastest
   there; paged prefill goes through its `flash_attn_with_kvcache` (`cu_seqlens_q`, `page_table`).
2. "fa4", FA4 (`flash_attn.cute`, flash-attn-4 over the CuTe DSL): Hopper and Blackwell (no
   paged KV on SM 8.x/12.x); slower than FA3 on Hopper by its maintainers' account, 1.15-3.2x
   faster than our kernels on an H100 (docs/PERF.md).
3. "fa2", FA2 (`flash_attn.flash_attn_interface`): Ampere on; last, because its paged path
   needs block sizes that are a multiple of 256, which the backend then refuses otherwise.
Otherwise, and on every other device, "ours": `pagedattn.flash_attn_interface` (FlashAttention's
API on our Triton kernels). PAGEDATTN_FLASH_ATTN_PROVIDER=ours|fa4|fa3|fa2 pins one (a pinned
provider that cannot run is an error, never a silent fallback).

NOT TESTED on a device: the fa3 and fa2 adapters (no wheel for this project's torch/CUDA);
the fa4 adapter's argument mapping is tested on the CPU against a fake FA4
(tests/backend_flash_attn) and awaits tests/kernels/test_flash_attn_dao.py on an H100.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, field

import torch

from pagedattn.attention import registry
from pagedattn.attention.backend import Capabilities

ENV_VAR = registry.PROVIDER_ENV_VARS["flash_attn"]  # read by the registry (pinned_provider)
DAO_ORDER = ("fa3", "fa4", "fa2")  # tried in this order; "ours" when none runs
MODULES = {"fa3": "flash_attn_interface", "fa4": "flash_attn.cute", "fa2": "flash_attn.flash_attn_interface"}
DISTRIBUTIONS = {"fa3": ("flash_attn_3", "flash-attn-3"), "fa4": ("flash-attn-4",), "fa2": ("flash-attn", "flash_attn")}
HALF = (torch.float16, torch.bfloat16)
NO_ALIBI = "{} takes no ALiBi slopes"
NO_SINKS = "{} takes no attention sinks (FA4's learnable_sink is what runs them)"


@dataclass(frozen=True)
class Provider:
    """One provider: its name, a label for logs, its API and what it can do."""

    name: str  # "ours", "fa4", "fa3", "fa2"
    label: str  # e.g. "FA4 4.0.0b36 (flash_attn.cute)"
    api: object  # flash_attn_varlen_func / flash_attn_with_kvcache, FlashAttention 2 style
    capabilities: Capabilities
    block_size_multiple: int = 1  # paged block sizes it takes
    cuda_graphs: str = "captured as any call"  # what a CUDA-graph capture needs
    limits: str = ""  # its limits in words, for refusals


@dataclass(frozen=True)
class Choice:
    """The provider chosen for a device type, and why each Dao-AILab build is not it."""

    provider: Provider | None  # None: the pinned one does not run
    why_not: dict[str, str] = field(default_factory=dict)  # name -> reason ("" for the chosen)
    pinned: str | None = None

    def describe(self) -> str:
        others = "; ".join(f"{n.upper()}: {w}" for n, w in self.why_not.items() if w)
        if self.provider is None:
            return f"{ENV_VAR}={self.pinned} pins a provider that does not run here ({others})"
        pin = f" (pinned by {ENV_VAR})" if self.pinned else ""
        return f"{self.provider.label}{pin}" + (f"; not Dao-AILab's flash_attn: {others}" if others else "")


class ProviderUnavailableError(RuntimeError):
    """The provider pinned by PAGEDATTN_FLASH_ATTN_PROVIDER cannot run here."""


# ----------------------------------------------------------------------------- choosing


def machine_device_type() -> str:
    """The device type the backend's capabilities describe: cuda when present."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def installed(name: str) -> bool:
    """Whether provider `name`'s module is on the path, importing nothing (a package's
    `__init__` may load CUDA libraries)."""
    top, _, rest = MODULES[name].partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):  # a None in sys.modules: its import is blocked
        return False
    if spec is None or not rest:
        return spec is not None
    sub = rest.replace(".", os.sep)
    return any(os.path.exists(os.path.join(loc, sub)) or os.path.exists(os.path.join(loc, sub + ".py"))
               for loc in (spec.submodule_search_locations or ()))


@functools.cache
def choose(device_type: str) -> Choice:
    """The provider for tensors on `device_type` (cached): the pinned one, else the first of
    DAO_ORDER that runs, else ours. Never raises; a bad pin is in the Choice."""
    pin = registry.pinned_provider("flash_attn")
    if pin is not None and pin not in ("ours", *DAO_ORDER):
        return Choice(None, {"pin": f"expected one of ours, {', '.join(DAO_ORDER)}, got {pin!r}"}, pin)
    names = DAO_ORDER if pin in (None, "ours") else (pin,)
    why_not: dict[str, str] = {}
    for name in names:
        if pin == "ours":
            why_not[name] = "not tried (pinned: ours)"
            continue
        provider, why = _load(name, device_type)
        why_not[name] = why
        if provider is not None:
            return Choice(provider, why_not, pin)
    return Choice(ours() if pin in (None, "ours") else None, why_not, pin)


def require(device_type: str) -> Provider:
    """`choose(device_type).provider`, or ProviderUnavailableError saying why there is none."""
    choice = choose(device_type)
    if choice.provider is None:
        raise ProviderUnavailableError(f"flash_attn backend: {choice.describe()}")
    return choice.provider


def _load(name: str, device_type: str) -> tuple[Provider | None, str]:
    """Provider `name` on `device_type` and "" when it runs, else (None, why not). Never raises."""
    if not installed(name):
        return None, f"{MODULES[name]} not installed"
    if device_type != "cuda":
        return None, f"installed, but runs on CUDA only (tensors on {device_type})"
    try:
        provider = _LOADERS[name](torch.cuda.get_device_capability())
    except Exception as e:  # noqa: BLE001 - a build for another torch can fail in many ways
        return None, f"{MODULES[name]} does not import: {type(e).__name__}: {e}"
    if isinstance(provider, str):
        return None, provider
    why = smoke_test(provider)
    return (None, why) if why else (provider, "")


def smoke_test(provider: Provider, device: torch.device | str = "cuda") -> str:
    """One decode of 2 query heads over 40 keys in shuffled pages (of 16 keys, or FA2's 256)
    through `provider.api`, against a dense float32 reference: "" when it agrees, else why not
    (never raises)."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        page = max(16, provider.block_size_multiple)
        k_cache, v_cache = (torch.randn(4, page, 1, 64, generator=g).to(device, torch.bfloat16) for _ in range(2))
        q = torch.randn(1, 1, 2, 64, generator=g).to(device, torch.bfloat16)
        table = torch.tensor([[3, 0, 2]], dtype=torch.int32, device=device)
        lens = torch.tensor([40], dtype=torch.int32, device=device)
        out = provider.api.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                                   softmax_scale=0.125, causal=True)
        keys = k_cache[[3, 0, 2]].flatten(0, 1)[:40, 0].float()  # [40, 64]
        values = v_cache[[3, 0, 2]].flatten(0, 1)[:40, 0].float()
        ref = ((q[0, 0].float() @ keys.T) * 0.125).softmax(-1) @ values  # [2, 64]
        err = ((out[0, 0].float() - ref).norm() / ref.norm()).item()
    except Exception as e:  # noqa: BLE001 - why it fails is the answer
        return f"imports but does not run here: {type(e).__name__}: {str(e)[:300]}"
    return "" if err < 2e-2 else f"runs but disagrees with a dense reference (rel L2 {err:.3g})"


def _version(name: str, module) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in DISTRIBUTIONS[name]:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return getattr(module, "__version__", "?")


# ----------------------------------------------------------------------------- ours


@functools.cache
def ours() -> Provider:
    import pagedattn.flash_attn_interface as api
    from pagedattn.backends import triton_backend

    return Provider("ours", "pagedattn.flash_attn_interface (our Triton kernels)", api,
                    triton_backend.TritonBackend.capabilities)


# ----------------------------------------------------------------------------- FA4


def _fa4(arch: tuple[int, int]) -> Provider | str:
    major = arch[0]
    if major not in (9, 10, 11):
        return f"FA4 has no paged KV cache on SM {major}.x (its interface asserts so)"
    import flash_attn.cute as cute

    if major == 9:
        head_sizes = tuple(range(8, 257, 8))
        sizes = "8..256, multiples of 8"
    else:
        head_sizes = tuple(range(8, 129, 8)) + (256,)
        sizes = "8..128 multiples of 8, or 256"
    label = f"FA4 {_version('fa4', cute)} (flash_attn.cute, SM {major}.x)"
    fp8 = "FP8 KV cache (FA4 reads FP8 only with FP8 queries, and only on SM 10.x)"
    # sinks: FA4's `learnable_sink` (its SM 9.x and SM 10.x forward kernels; on SM 10.x not at
    # head size 256, which FA4 asserts at the call)
    caps = Capabilities(head_sizes=head_sizes, dtypes=HALF, kv_cache_dtypes=("auto",), alibi=False, sinks=True,
                        two_sided_window=True, why_not=(("alibi", NO_ALIBI.format("FA4")),))
    limits = (f"float16/bfloat16 queries; head sizes {sizes}; no {fp8}; no ALiBi; "
              "each new shape variant compiles on its first call (CuTe DSL JIT, seconds)")
    return Provider("fa4", label, FA4Api(cute.flash_attn_varlen_func), caps,
                    cuda_graphs="after one warm-up call per shape variant (the first call compiles); "
                                "no host synchronisation on the call path",
                    limits=limits)


def _fa4_window(window_size) -> tuple[int | None, int | None]:
    """FlashAttention 2's (left, right), -1 unbounded, as FA4's (None unbounded)."""
    left, right = (int(w) for w in window_size)
    return (None if left < 0 else left), (None if right < 0 else right)


def _refuse(provider: str, **given) -> None:
    """NotImplementedError naming the first argument given that `provider` does not take."""
    for name, value in given.items():
        if value is not None and (isinstance(value, torch.Tensor) or value):
            raise NotImplementedError(f"{provider} provider: {name} is not supported by it "
                                      f"(pin {ENV_VAR}=ours to run it on our kernels)")


class FA4Api:
    """FlashAttention 2's entry points over FA4's `flash_attn_varlen_func`.

    FA4 writes a new output tensor (its public function takes no `out=`): it is copied into
    `out` when one is given. Paged calls pass `block_table` as FA4's `page_table` with the
    per-sequence key counts as `seqused_k` (FA4 takes no `cu_seqlens_k` with a page table);
    decode passes q as [B, Sq, Hq, D], FA4's batched form, whose LSE is [B, Hq, Sq] as
    FlashAttention 2's kvcache LSE. `num_splits` is not passed (FA4 on SM 9.x has no split-KV).
    """

    def __init__(self, varlen):
        self.varlen = varlen  # flash_attn.cute.flash_attn_varlen_func

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                               softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                               block_table=None, out=None, *, k_descale=None, v_descale=None, learnable_sink=None):
        """As `pagedattn.flash_attn_interface.flash_attn_varlen_func`; q [total_q, Hq, D] fp16/bf16."""
        _refuse("FA4", dropout_p=dropout_p, alibi_slopes=alibi_slopes, k_descale=k_descale, v_descale=v_descale)
        options = dict(cu_seqlens_q=cu_seqlens_q, max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k),
                       softmax_scale=softmax_scale, causal=causal, window_size=_fa4_window(window_size),
                       learnable_sink=learnable_sink, softcap=float(softcap) if softcap > 0 else 0.0,
                       return_lse=bool(return_attn_probs))
        if block_table is None:
            o, lse = self.varlen(q, k, v, cu_seqlens_k=cu_seqlens_k, **options)
        else:
            used = cu_seqlens_k[1:] - cu_seqlens_k[:-1]  # [B] int32 key counts
            o, lse = self.varlen(q, k, v, seqused_k=used, page_table=block_table, **options)
        o = _into(out, o)
        return (o, lse, None) if return_attn_probs else o  # lse [Hq, total_q]

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                                return_softmax_lse=False, *, out=None, k_descale=None, v_descale=None,
                                learnable_sink=None):
        """As `pagedattn.flash_attn_interface.flash_attn_with_kvcache` without appending
        (`k`/`v`), rotary, `cache_batch_idx` or `cache_leftpad`; q [B, Sq, Hq, D] fp16/bf16."""
        _refuse("FA4", k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx,
                cache_leftpad=cache_leftpad, alibi_slopes=alibi_slopes, k_descale=k_descale, v_descale=v_descale)
        if isinstance(cache_seqlens, int):
            cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
        options = dict(seqused_k=cache_seqlens, softmax_scale=softmax_scale, causal=causal,
                       window_size=_fa4_window(window_size), learnable_sink=learnable_sink,
                       softcap=float(softcap) if softcap > 0 else 0.0, return_lse=bool(return_softmax_lse))
        o, lse = self.varlen(q, k_cache, v_cache, page_table=block_table, **options)
        o = _into(out, o)
        return (o, lse) if return_softmax_lse else o  # lse [B, Hq, Sq]


def _into(out, o):
    """`o`, copied into `out` when the caller gave one (then `out` is the result)."""
    if out is None:
        return o
    out.copy_(o)
    return out


# ----------------------------------------------------------------------------- FA3, FA2


def _fa3(arch: tuple[int, int]) -> Provider | str:
    if arch[0] != 9:
        return f"FA3 (the hopper build) runs on SM 9.x only, this GPU is SM {arch[0]}.{arch[1]}"
    import flash_attn_interface as fa3

    caps = Capabilities(head_sizes=tuple(range(8, 257, 8)), dtypes=HALF, kv_cache_dtypes=("auto",), alibi=False,
                        two_sided_window=True,
                        why_not=(("alibi", NO_ALIBI.format("FA3")), ("sinks", NO_SINKS.format("FA3"))))
    return Provider("fa3", f"FA3 {_version('fa3', fa3)} (flash_attn_interface)", FA3Api(fa3), caps,
                    limits="float16/bfloat16 queries; head sizes up to 256, multiples of 8; no FP8 KV cache "
                           "with 16-bit queries; no ALiBi; no attention sinks")


class FA3Api:
    """FlashAttention 2's entry points over FA3's: paged prefill is FA3's `flash_attn_with_kvcache`
    with `cu_seqlens_q`/`max_seqlen_q` (FA3's varlen function has no page table); outputs
    are copied into `out`."""

    def __init__(self, module):
        self.fa3 = module

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                               softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                               block_table=None, out=None, *, k_descale=None, v_descale=None, learnable_sink=None):
        _refuse("FA3", dropout_p=dropout_p, alibi_slopes=alibi_slopes, k_descale=k_descale, v_descale=v_descale,
                learnable_sink=learnable_sink)
        options = dict(softmax_scale=softmax_scale, causal=causal, window_size=tuple(window_size), softcap=softcap)
        if block_table is None:
            res = self.fa3.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  return_attn_probs=return_attn_probs, **options)
        else:
            res = self.fa3.flash_attn_with_kvcache(q, k, v, cache_seqlens=cu_seqlens_k[1:] - cu_seqlens_k[:-1],
                                                   page_table=block_table, cu_seqlens_q=cu_seqlens_q,
                                                   max_seqlen_q=int(max_seqlen_q),
                                                   return_softmax_lse=return_attn_probs, **options)
        if not return_attn_probs:
            return _into(out, res)
        return _into(out, res[0]), res[1], None

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                                return_softmax_lse=False, *, out=None, k_descale=None, v_descale=None,
                                learnable_sink=None):
        _refuse("FA3", alibi_slopes=alibi_slopes, k_descale=k_descale, v_descale=v_descale,
                learnable_sink=learnable_sink)
        res = self.fa3.flash_attn_with_kvcache(
            q, k_cache, v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, page_table=block_table,
            softmax_scale=softmax_scale, causal=causal, window_size=tuple(window_size), softcap=softcap,
            rotary_interleaved=rotary_interleaved, num_splits=num_splits, return_softmax_lse=return_softmax_lse)
        if not return_softmax_lse:
            return _into(out, res)
        return _into(out, res[0]), res[1]


def _fa2(arch: tuple[int, int]) -> Provider | str:
    if arch[0] < 8:
        return f"FA2 needs SM 8.0 or newer, this GPU is SM {arch[0]}.{arch[1]}"
    from flash_attn import flash_attn_interface as fa2

    caps = Capabilities(head_sizes=tuple(range(8, 257, 8)), dtypes=HALF, kv_cache_dtypes=("auto",),
                        two_sided_window=True, why_not=(("sinks", NO_SINKS.format("FA2")),))
    return Provider("fa2", f"FA2 {_version('fa2', fa2)} (flash_attn.flash_attn_interface)", FA2Api(fa2), caps,
                    block_size_multiple=256,
                    limits="float16/bfloat16 queries; head sizes up to 256, multiples of 8; no FP8 KV cache; "
                           "paged block sizes multiples of 256; no attention sinks")


class FA2Api:
    """FlashAttention 2 itself, with `out=` (copied into) and FP8 descales (refused) added."""

    def __init__(self, module):
        self.fa2 = module

    def flash_attn_varlen_func(self, *args, out=None, k_descale=None, v_descale=None, learnable_sink=None, **kwargs):
        _refuse("FA2", k_descale=k_descale, v_descale=v_descale, learnable_sink=learnable_sink)
        res = self.fa2.flash_attn_varlen_func(*args, **kwargs)
        return (_into(out, res[0]), *res[1:]) if isinstance(res, tuple) else _into(out, res)

    def flash_attn_with_kvcache(self, *args, out=None, k_descale=None, v_descale=None, learnable_sink=None,
                                **kwargs):
        _refuse("FA2", k_descale=k_descale, v_descale=v_descale, learnable_sink=learnable_sink)
        res = self.fa2.flash_attn_with_kvcache(*args, **kwargs)
        return (_into(out, res[0]), *res[1:]) if isinstance(res, tuple) else _into(out, res)


_LOADERS = {"fa3": _fa3, "fa4": _fa4, "fa2": _fa2}
