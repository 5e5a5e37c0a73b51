"""Dense float64 reference attention (output and LSE) for every test of attention numbers.

The oracle never looks at a paged cache. Tests hand it each sequence's full key/value history
as dense tensors (the same values they scattered into the cache with their own loop), so a
wrong slot, a wrong block table or a wrong mask in a backend shows up as a wrong number here.

Semantics follow shared/API.md section 3, in this order:
    s = scale * q.k
    s = c * tanh(s / c)                    (logits_soft_cap c)
    s += slope_h * (key_pos - query_pos)   (ALiBi)
    mask: key_pos <= query_pos (causal) and key_pos > query_pos - W (sliding window W);
          query_pos - left <= key_pos <= query_pos + right (FlashAttention's window (left, right),
          -1 unbounded on that side)
    softmax over keys (and the head's sink logit, with a value of 0), then the weighted sum of values
GQA/MQA: query head h reads KV head h // (Hq // Hkv). The LSE is the natural log of the
softmax denominator, per (query token, head), as kernels that merge partial results report it.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = [
    "DTYPES",
    "FP8_DTYPES",
    "Tolerance",
    "tolerance_for",
    "fp8_quantize",
    "fp8_dequantize",
    "fp8_roundtrip",
    "dense_attention",
    "dense_attention_with_lse",
    "rel_l2",
    "assert_attention_close",
    "assert_outputs_differ",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------- tolerances


class Tolerance:
    """Elementwise `|out - ref| <= atol + rtol * |ref|` plus a relative-L2 bound on the whole."""

    def __init__(self, atol: float, rtol: float, rel_l2: float):
        self.atol, self.rtol, self.rel_l2 = atol, rtol, rel_l2

    def __repr__(self) -> str:
        return f"Tolerance(atol={self.atol}, rtol={self.rtol}, rel_l2={self.rel_l2})"


_TOL = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4, rel_l2=2e-5),
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3, rel_l2=1.5e-3),
    torch.bfloat16: Tolerance(atol=1.5e-2, rtol=1.5e-2, rel_l2=1e-2),
}
# An FP8 cache compares the attention math on identically quantised K/V; what remains is the
# rounding of the query/model dtype plus the odd fp8 rounding tie the backend resolves in a
# different precision than the test does.
_FP8_TOL = Tolerance(atol=1e-2, rtol=1e-2, rel_l2=6e-3)


def tolerance_for(dtype: torch.dtype, fp8_cache: bool = False) -> Tolerance:
    base = _TOL[dtype]
    if not fp8_cache:
        return base
    return Tolerance(max(base.atol, _FP8_TOL.atol), max(base.rtol, _FP8_TOL.rtol),
                     max(base.rel_l2, _FP8_TOL.rel_l2))


# ----------------------------------------------------------------------------- FP8


def fp8_quantize(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype) -> torch.Tensor:
    """What an FP8 cache stores for `x`: saturate(x / scale) rounded to `fp8_dtype`.

    The division is IEEE float32 division by the float32 scale (API: every backend stores the
    same bits); values beyond the format's largest finite number saturate instead of turning
    into inf/NaN.
    """
    fmax = torch.finfo(fp8_dtype).max
    divisor = torch.tensor(float(scale), dtype=torch.float32, device=x.device)  # true division
    return (x.float() / divisor).clamp(-fmax, fmax).to(fp8_dtype)


def fp8_dequantize(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """What a backend reads back from an FP8 cache, in float64: stored * scale."""
    return stored.to(torch.float64) * float(scale)


def fp8_roundtrip(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype) -> torch.Tensor:
    """dequant(quant(x / scale)) * scale, in float64."""
    return fp8_dequantize(fp8_quantize(x, scale, fp8_dtype), scale)


# ----------------------------------------------------------------------------- attention


def dense_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    query_pos: torch.Tensor | Sequence[int] | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    window: tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: Sequence[float] | torch.Tensor | None = None,
    sinks: Sequence[float] | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence and its log-sum-exp, in float64 on q's device.

    q: [Lq, Hq, D]; k, v: [Lk, Hkv, D] (any float dtype, any device; promoted to float64).
    query_pos: absolute position of each query row; keys sit at positions 0..Lk-1. The default
    is bottom-right alignment, `Lk - Lq + i`, i.e. the queries are the last Lq tokens.
    window: (left, right), keys in [query_pos - left, query_pos + right], -1 unbounded (with
    `sliding_window` W too, both apply).
    Returns (out [Lq, Hq, D] float64, lse [Lq, Hq] float64), lse the natural log of the sum of
    exp(score) over the keys the query sees, and exp(sinks[h]) with sinks (a sink joins the
    denominator only). A query that sees no key gets out 0 and lse -inf (sinks[h] with sinks).
    NaN/Inf in q, or in a key/value the query sees, reach that query's row; a key or value the
    query does not see never does (it is left out before the matmul, as a backend must).
    """
    dev = q.device
    q, k, v = (t.to(dev, torch.float64) for t in (q, k, v))
    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    assert hq % hkv == 0, f"expected Hq a multiple of Hkv, got {hq} and {hkv}"
    group = hq // hkv
    # query head h reads KV head h // group
    k = k.repeat_interleave(group, dim=1)  # [Lk, Hq, D]
    v = v.repeat_interleave(group, dim=1)  # [Lk, Hq, D]

    f64 = dict(dtype=torch.float64, device=dev)
    qpos = (torch.arange(lk - lq, lk, **f64) if query_pos is None
            else torch.as_tensor(query_pos, dtype=torch.float64).to(dev))
    kpos = torch.arange(lk, **f64)
    rel = kpos[None, :] - qpos[:, None]  # [Lq, Lk] key_pos - query_pos

    s = torch.einsum("qhd,khd->hqk", q, k) * float(scale)  # [Hq, Lq, Lk]
    if logits_soft_cap is not None:
        c = float(logits_soft_cap)
        s = c * torch.tanh(s / c)
    if alibi_slopes is not None:
        slopes = torch.as_tensor(alibi_slopes, dtype=torch.float64).to(dev).reshape(hq)
        s = s + slopes[:, None, None] * rel[None]

    allowed = torch.ones(lq, lk, dtype=torch.bool, device=dev)
    if causal:
        allowed &= rel <= 0
    if sliding_window is not None:
        allowed &= rel > -int(sliding_window)
    if window is not None:
        left, right = (int(w) for w in window)
        if left >= 0:
            allowed &= rel >= -left
        if right >= 0:
            allowed &= rel <= right
    s = s.masked_fill(~allowed[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, Lq]; -inf where the query sees no key
    if sinks is not None:
        sink = torch.as_tensor(sinks, dtype=torch.float64).to(dev).reshape(hq, 1)
        lse = torch.logaddexp(lse, sink.expand_as(lse))
    seen = allowed.any(dim=1)  # [Lq]
    p = torch.exp(s - lse[..., None]).masked_fill(~seen[None, :, None], 0.0)  # [Hq, Lq, Lk]
    if bool(torch.isfinite(v).all()):
        out = torch.einsum("hqk,khd->qhd", p, v)  # [Lq, Hq, D]
    else:
        # 0 * NaN is NaN: a non-finite value must be dropped for the queries that cannot see
        # it, not multiplied by a zero weight, so each query sums over its visible keys only.
        out = torch.zeros(lq, hq, d, **f64)
        for i in range(lq):
            keys = allowed[i].nonzero().flatten()
            out[i] = torch.einsum("hk,khd->hd", p[:, i, keys], v[keys])
    return out, lse.transpose(0, 1)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                    **options) -> torch.Tensor:
    """`dense_attention_with_lse` without the LSE: out [Lq, Hq, D] float64."""
    return dense_attention_with_lse(q, k, v, scale=scale, **options)[0]


# ----------------------------------------------------------------------------- comparison


def _describe_mismatch(out: torch.Tensor, ref: torch.Tensor) -> str:
    err = (out - ref).abs()
    idx = int(err.argmax())
    where = list(torch.unravel_index(torch.tensor(idx), err.shape))
    return (f"max abs err {float(err.max()):.3e} at {[int(i) for i in where]} "
            f"(got {float(out.flatten()[idx]):.6f}, expected {float(ref.flatten()[idx]):.6f})")


def _check(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> str | None:
    """None when `out` matches `ref` within `tol`, else a message."""
    if out.shape != ref.shape:
        return f"expected shape {tuple(ref.shape)}, got {tuple(out.shape)}"
    if not bool(torch.isfinite(out).all()):
        return f"output has {int((~torch.isfinite(out)).sum())} non-finite values"
    err = (out - ref).abs()
    bad = err > tol.atol + tol.rtol * ref.abs()
    if bool(bad.any()):
        return f"{int(bad.sum())}/{bad.numel()} elements off; " + _describe_mismatch(out, ref)
    denom = float(ref.norm())
    rel = float((out - ref).norm()) / denom if denom > 0 else float((out - ref).norm())
    if rel > tol.rel_l2:
        return f"relative L2 error {rel:.3e} > {tol.rel_l2:.1e}; " + _describe_mismatch(out, ref)
    return None


def assert_attention_close(
    out: torch.Tensor,
    refs: torch.Tensor | Sequence[torch.Tensor],
    tol: Tolerance,
    row_groups: Sequence[tuple[int, int]] | None = None,
    what: str = "attention output",
) -> None:
    """Checks `out` [T, Hq, D] (or [T, Hq*D]) against the oracle.

    `refs` holds one or more acceptable [T, Hq, D] float64 references. With `row_groups`
    (one (start, end) row range per sequence) each sequence may match a different reference:
    an FP8 backend may read the step's own new tokens either from the quantised cache or from
    the unquantised inputs (API.md section 3), and the choice may differ per sequence.
    """
    if isinstance(refs, torch.Tensor):
        refs = [refs]
    ref0 = refs[0]
    out = out.detach().to("cpu", torch.float64).reshape(ref0.shape)
    groups = row_groups if row_groups is not None else [(0, ref0.shape[0])]
    for i, (a, b) in enumerate(groups):
        if a == b:
            continue
        msgs = [_check(out[a:b], r[a:b], tol) for r in refs]
        if all(m is not None for m in msgs):
            raise AssertionError(
                f"{what}: sequence {i} (rows {a}:{b}) does not match the oracle with {tol}: "
                + " | ".join(msgs))


def assert_outputs_differ(a: torch.Tensor, b: torch.Tensor, min_diff: float, what: str) -> None:
    """An option that changes nothing is a bug: the outputs with and without it must differ."""
    diff = float((a.detach().to("cpu", torch.float64) - b.detach().to("cpu", torch.float64))
                 .abs().max())
    assert diff > min_diff, f"{what} did not change the output (max diff {diff:.3e})"


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 on the CPU."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))
