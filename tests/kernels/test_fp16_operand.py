"""`_fp16_operand`: bf16 queries meet FP8 keys as fp16, scaled by an exact power of two."""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from pagedattn.kernels.attention_program import _fp16_operand  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _probe(q_ptr, out_ptr, down_ptr, M: tl.constexpr, D: tl.constexpr):
    offs = tl.arange(0, M)[:, None] * D + tl.arange(0, D)[None, :]
    q16, down = _fp16_operand(tl.load(q_ptr + offs))
    tl.store(out_ptr + offs, q16)
    tl.store(down_ptr, down)


def run(q: torch.Tensor) -> tuple[torch.Tensor, float]:
    q = q.to(DEVICE, torch.bfloat16)
    out = torch.empty(q.shape, dtype=torch.float16, device=DEVICE)
    down = torch.empty(1, dtype=torch.float32, device=DEVICE)
    _probe[(1,)](q, out, down, M=q.shape[0], D=q.shape[1])
    return out.cpu(), down.item()


@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1.0, 3e4, 1e9, 1e37])
def test_every_bf16_range_scales_exactly(magnitude):
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(16, 32, generator=g) * magnitude).to(torch.bfloat16)
    q16, down = run(q)
    assert torch.isfinite(q16).all() and q16.abs().max() >= 2 ** 15  # the largest lands in [2^15, 2^16)
    assert down == 2.0 ** round(torch.log2(torch.tensor(down)).item())  # a power of two
    big = q.float().abs() >= q.float().abs().max() * 2 ** -10  # all that fp16 keeps to the last bit
    torch.testing.assert_close((q16.double() * down)[big], q.double()[big], atol=0, rtol=0)
    small = (q16.double() * down - q.double()).abs().max().item()
    assert small <= q.float().abs().max().item() * 2 ** -24


def test_zero_stays_zero():
    q16, down = run(torch.zeros(16, 16))
    assert (q16 == 0).all() and down > 0
