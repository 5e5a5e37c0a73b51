"""The fused layer kernels against the PyTorch ops they replace in the Llama family's layers
(`models.layers`: RMSNorm with the residual add, rotary, SiLU-and-mul), in every model dtype.

The kernels round where PyTorch rounds, so in float32 they agree to float32 rounding and in
half precision to one unit of the last place; on the CPU they run under the Triton interpreter,
whose float32 -> bfloat16 casts truncate instead of rounding (the exact checks skip that case)."""

import pytest
import torch

pytest.importorskip("triton")

from pagedattn.kernels._common import INTERPRET  # noqa: E402
from pagedattn.kernels.fused_layers import rms_norm, rotary_, silu_and_mul  # noqa: E402
from pagedattn.models.layers import RMSNorm, apply_rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _close(got, want, dtype):
    """Within one rounding of the dtype (the last op of each side may round differently)."""
    tol = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol * 4, rtol=tol)


def _randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 80, 576])
def test_rms_norm_with_and_without_the_residual_add(dtype, hidden):
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(1)))
    norm = norm.to(DEVICE, dtype)
    x, residual = _randn(7, hidden, dtype=dtype, seed=2), _randn(7, hidden, dtype=dtype, seed=3)
    want_sum = (x.cpu() + residual.cpu())
    cpu_norm = RMSNorm(hidden, 1e-5).to(dtype)
    cpu_norm.weight.data.copy_(norm.weight.data.cpu())
    with torch.no_grad():
        _close(rms_norm(x, norm.weight, 1e-5), cpu_norm(x.cpu()), dtype)
        out, summed = rms_norm(x, norm.weight, 1e-5, residual)
        want_out, want = cpu_norm(x.cpu(), residual.cpu())
    assert torch.equal(want, want_sum)
    if INTERPRET and dtype == torch.bfloat16:
        _close(summed, want_sum, dtype)
    else:
        assert torch.equal(summed.cpu(), want_sum)  # the add rounds once, as PyTorch's
    _close(out, want_out, dtype)


def test_rms_norm_of_strided_rows_and_no_rows():
    wide = _randn(5, 96, dtype=torch.float32, seed=4)
    w = torch.ones(64, device=DEVICE)
    _close(rms_norm(wide[:, :64], w, 1e-6), torch.nn.functional.rms_norm(wide[:, :64].cpu(), (64,), eps=1e-6),
           torch.float32)
    assert rms_norm(wide[:0, :64], w, 1e-6).shape == (0, 64)
    with pytest.raises(ValueError, match="weight.shape"):
        rms_norm(wide, w, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_size", [(6, 64), (3, 80), (20, 128)])
def test_rotary_in_place_equals_apply_rope(dtype, heads, head_size):
    """q and k heads of a stacked qkv row rotated in place; v (the columns after) untouched."""
    tokens = 5
    qkv = _randn(tokens, (heads + 2) * head_size, dtype=dtype, seed=5)
    angle = torch.rand(tokens, 1, head_size // 2, generator=torch.Generator().manual_seed(6)) * 6
    cos, sin = angle.cos().to(DEVICE, dtype), angle.sin().to(DEVICE, dtype)
    qk = qkv[:, : (heads + 1) * head_size].view(tokens, heads + 1, head_size)
    want = apply_rope(qk.cpu(), cos.cpu(), sin.cpu())
    v_before = qkv[:, (heads + 1) * head_size :].clone()
    assert rotary_(qk, cos, sin) is qk
    _close(qk, want, dtype)
    assert torch.equal(qkv[:, (heads + 1) * head_size :], v_before)


def test_rotary_refuses_mismatched_tables():
    x = _randn(4, 2, 16, dtype=torch.float32, seed=7)
    with pytest.raises(ValueError, match="cos.shape"):
        rotary_(x, torch.ones(3, 8, device=DEVICE), torch.ones(4, 8, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", [48, 1536, 2500])
def test_silu_and_mul(dtype, inner):
    x = _randn(3, 2 * inner, dtype=dtype, seed=8)
    gate, up = x.cpu().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate).mul_(up)
    _close(silu_and_mul(x), want, dtype)
