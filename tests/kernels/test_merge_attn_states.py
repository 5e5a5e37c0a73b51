"""merge_attn_states against a float64 merge, including empty (+-inf LSE) parts."""

import math

import pytest
import torch

pytest.importorskip("triton")

from pagedattn.kernels import merge_attn_states  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 80])
def test_merge_equals_attention_over_the_union(dtype, head_size):
    g = torch.Generator().manual_seed(5)
    num_tokens, num_heads, len_a, len_b = 6, 3, 7, 4
    q = torch.randn(num_tokens, num_heads, head_size, generator=g, dtype=torch.float64)
    k = torch.randn(len_a + len_b, num_heads, head_size, generator=g, dtype=torch.float64)
    v = torch.randn(len_a + len_b, num_heads, head_size, generator=g, dtype=torch.float64)
    s = torch.einsum("thd,lhd->thl", q, k) / math.sqrt(head_size)

    def part(sl):
        lse = torch.logsumexp(s[..., sl], -1)
        return torch.einsum("thl,lhd->thd", torch.softmax(s[..., sl], -1), v[sl]), lse

    (o_a, l_a), (o_b, l_b), (o_all, l_all) = part(slice(0, len_a)), part(slice(len_a, None)), \
        part(slice(None))
    # token 0: part b empty (-inf); token 1: part a empty reported as +inf; token 2: both empty
    l_b[0] = -math.inf
    l_a[1] = math.inf
    l_a[2] = l_b[2] = -math.inf
    want_o, want_l = o_all.clone(), l_all.clone()
    want_o[0], want_l[0] = o_a[0], l_a[0]
    want_o[1], want_l[1] = o_b[1], l_b[1]
    want_o[2], want_l[2] = 0.0, -math.inf
    to = dict(device=DEVICE)
    out = torch.empty(num_tokens, num_heads, head_size, dtype=dtype, **to)
    out_lse = torch.empty(num_tokens, num_heads, **to)
    merge_attn_states(out, o_a.to(dtype).to(**to), l_a.float().to(**to), o_b.to(dtype).to(**to),
                      l_b.float().to(**to), out_lse)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.double().cpu(), want_o, atol=tol, rtol=tol)
    torch.testing.assert_close(out_lse.double().cpu(), want_l, atol=1e-5, rtol=1e-5)


def test_merge_without_lse_output_and_shape_errors():
    a = torch.randn(2, 2, 32, device=DEVICE)
    lse = torch.zeros(2, 2, device=DEVICE)
    out = torch.empty_like(a)
    merge_attn_states(out, a, lse, a, lse)  # equal parts: the average of equal outputs
    torch.testing.assert_close(out, a)
    with pytest.raises(ValueError, match="expected"):
        merge_attn_states(out, a, lse[:1], a, lse)
