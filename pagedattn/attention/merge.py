"""`merge_attn_states`: attention over two disjoint sets of keys, merged by their log-sum-exps.

A query's attention over keys A and B (a cascade: a shared prefix and each sequence's own
suffix; or two chunks of one sequence's keys) is the attention over A and over B, each with the
natural-log LSE of its softmax denominator (`impl.forward(..., return_lse=True)`), merged:

    m = max(lse_a, lse_b);  w_a = exp(lse_a - m);  w_b = exp(lse_b - m)
    out = (w_a * out_a + w_b * out_b) / (w_a + w_b);  lse = m + log(w_a + w_b)

An empty part (LSE -inf, or +inf as some libraries write it) weighs nothing; both empty give
out 0 and LSE -inf. A part computed with attention sinks carries its sink in its LSE, so a
sink layer's attention is merged from one part with the sinks and one without. On CUDA, and on
the CPU under TRITON_INTERPRET=1, our Triton kernel (`kernels/merge_attn_states.py`) runs it;
elsewhere PyTorch does, in float32 (no Triton needed).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from pagedattn.dtypes import FLOAT_DTYPES


def merge_attn_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two parts' attention outputs by their LSEs (module docstring).

    Args:
        out_a, out_b: [T, H, D] (or [T, H*D], `forward`'s output) float32/float16/bfloat16, any
            strides, on one device.
        lse_a, lse_b: [T, H] float32, natural log (`forward(..., return_lse=True)`'s).
        out: optional result in out_a's shape, any float dtype (default: out_a's dtype); may be
            out_a or out_b itself, but may not otherwise share memory with an input or out_lse.
        out_lse: optional [T, H] float32 result; may be lse_a or lse_b itself, likewise.
    Returns:
        (out, lse): the merged output in out_a's shape, and its LSE [T, H] float32.
    Raises TypeError for a non-tensor, ValueError for a shape, dtype, device or overlap outside
    these, or for inputs that require grad under grad mode (forward only).
    """
    t, h, d = _check(out_a, lse_a, out_b, lse_b, out, out_lse)
    out = torch.empty_like(out_a) if out is None else out
    out_lse = torch.empty_like(lse_a) if out_lse is None else out_lse
    heads = [x.view(t, h, d) for x in (out, out_a, out_b)]  # [T, H, D]
    if _kernel_runs(out_a.device):
        from pagedattn.kernels import merge_attn_states as kernel

        kernel(heads[0], heads[1], lse_a, heads[2], lse_b, out_lse)
    else:
        _merge_torch(*heads, lse_a, lse_b, out_lse)
    return out, out_lse


def _check(out_a, lse_a, out_b, lse_b, out, out_lse) -> tuple[int, int, int]:
    """The merge's arguments as its docstring states them; returns (T, H, D)."""
    inputs = (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b))
    outputs = (("out", out), ("out_lse", out_lse))
    for (name, x), optional in zip(inputs + outputs, (False,) * 4 + (True,) * 2):
        if not isinstance(x, torch.Tensor) and not (optional and x is None):
            raise TypeError(f"expected {name} a torch.Tensor{' or None' if optional else ''}, got {type(x).__name__}")
    if lse_a.dim() != 2 or lse_a.dtype != torch.float32:
        raise ValueError(f"expected lse_a float32 [T, H], got {lse_a.dtype} {list(lse_a.shape)}")
    t, h = lse_a.shape
    shape = tuple(out_a.shape)
    if out_a.dim() == 3:
        ok, d = shape[:2] == (t, h), shape[2]
    else:
        ok, d = out_a.dim() == 2 and shape[0] == t and h > 0 and shape[1] % h == 0, shape[-1] // max(h, 1)
    if not ok:
        raise ValueError(f"expected out_a [{t}, {h}, D] or [{t}, {h}*D] (as lse_a [{t}, {h}]), got {list(shape)}")
    for name, x, want in (("lse_a", lse_a, (t, h)), ("out_b", out_b, shape), ("lse_b", lse_b, (t, h)),
                          ("out", out, shape), ("out_lse", out_lse, (t, h))):
        if x is not None and (tuple(x.shape) != want or x.device != out_a.device):
            raise ValueError(f"expected {name} of {list(want)} on {out_a.device}, got {list(x.shape)} on {x.device}")
    for name, x in (("out_a", out_a), ("out_b", out_b), ("out", out)):
        if x is not None and x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"expected {name} float32/float16/bfloat16, got {x.dtype}")
    for name, x in (("lse_b", lse_b), ("out_lse", out_lse)):
        if x is not None and x.dtype != torch.float32:
            raise ValueError(f"expected {name} float32, got {x.dtype}")
    grads = [name for name, x in inputs if x.requires_grad]
    if grads and torch.is_grad_enabled():
        raise ValueError(f"expected {grads[0]} without requires_grad under grad mode (the merge is forward only; "
                         "call it under torch.no_grad() or torch.inference_mode())")
    if out_a.device.type == "meta":
        return t, h, d  # no memory to overlap
    # cheap where it runs per layer (cascade attention): distinct storages never overlap
    storage = {name: x.untyped_storage().data_ptr() for name, x in inputs + outputs if x is not None}
    for name, x, itself in (("out", out, ("out_a", "out_b")), ("out_lse", out_lse, ("lse_a", "lse_b"))):
        if x is None:
            continue
        if not x.is_contiguous() and _self_overlaps(x):
            raise ValueError(f"expected {name} whose elements have distinct memory, got strides {x.stride()} for "
                             f"shape {list(x.shape)} (an expanded view?)")
        for other, y in inputs + outputs:
            if y is None or y is x or storage[other] != storage[name] or (other in itself and _same_view(x, y)):
                continue
            if _overlaps(x, y):
                raise ValueError(f"expected {name} to be {' or '.join(itself)} itself or memory of its own, got one "
                                 f"that overlaps {other}")
    return t, h, d


def _same_view(x: torch.Tensor, y: torch.Tensor) -> bool:
    return (x.data_ptr(), x.shape, x.stride(), x.dtype) == (y.data_ptr(), y.shape, y.stride(), y.dtype)


def _overlaps(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the byte ranges x and y span intersect (interleaved views count: a conservative test)."""
    if x.numel() == 0 or y.numel() == 0:
        return False
    (x0, x1), (y0, y1) = _span(x), _span(y)
    return x0 < y1 and y0 < x1


def _span(x: torch.Tensor) -> tuple[int, int]:
    last = sum((n - 1) * s for n, s in zip(x.shape, x.stride()))
    return x.data_ptr(), x.data_ptr() + (last + 1) * x.element_size()


def _self_overlaps(x: torch.Tensor) -> bool:
    """Whether two elements of x may share memory: each dim's stride must clear the reach of the
    dims with smaller strides (a sufficient test; expanded views fail it)."""
    reach = 1
    for stride, n in sorted((s, n) for n, s in zip(x.shape, x.stride()) if n > 1):
        if stride < reach:
            return True
        reach += (n - 1) * stride
    return False


def _kernel_runs(device: torch.device) -> bool:
    """Whether our Triton kernel runs on tensors of `device`: CUDA, or the CPU when the kernels
    are interpreted (`kernels._common.INTERPRET`, read when Triton is installed)."""
    if not _triton_installed():
        return False
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    from pagedattn.kernels._common import INTERPRET

    return INTERPRET


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None  # looked up once: a merge runs per layer


def _merge_torch(out, out_a, out_b, lse_a, lse_b, out_lse) -> None:
    """The merge in PyTorch, float32: out/out_a/out_b [T, H, D], lses [T, H] (outputs may alias)."""
    la = lse_a.masked_fill(lse_a == float("inf"), float("-inf"))
    lb = lse_b.masked_fill(lse_b == float("inf"), float("-inf"))
    m = torch.maximum(la, lb)
    m_safe = m.masked_fill(m == float("-inf"), 0.0)
    w_a, w_b = torch.exp(la - m_safe), torch.exp(lb - m_safe)
    w_sum = w_a + w_b
    empty = w_sum == 0.0
    inv = 1.0 / w_sum.masked_fill(empty, 1.0)
    merged = out_a.float() * (w_a * inv)[..., None] + out_b.float() * (w_b * inv)[..., None]
    lse = torch.where(empty, float("-inf"), m_safe + torch.log(w_sum.masked_fill(empty, 1.0)))
    out.copy_(merged)
    out_lse.copy_(lse)
