"""The model-facing layer: pagedattn.Attention under forward_context, torch.compile, opcheck."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import pagedattn
from cases import KERNEL_GRID, make_scenario, shapes
from oracle import tolerance_for

MIXED = shapes("mixed")[0]


def _layer(sc, backend_name, layer_idx, **opts):
    return pagedattn.Attention(sc.num_heads, sc.head_size, sc.default_scale, sc.num_kv_heads,
                               backend=backend_name, layer_idx=layer_idx, **opts)


def test_layer_equals_impl(backend, backend_name, device, model_dtype):
    sc = make_scenario(backend, MIXED, device=device, dtype=model_dtype, seed=70)
    other = torch.zeros_like(sc.kv_cache)  # layer 0's cache: must stay untouched
    layer = _layer(sc, backend_name, layer_idx=1)
    md = sc.build()
    q, k, v = (t.flatten(1) for t in (sc.query, sc.key, sc.value))
    with pagedattn.forward_context(md, [other, sc.kv_cache]):
        out = layer(q, k, v)
    sc.check(out)
    sc.check_cache_writes()
    assert not bool(other.any()), "the layer wrote another layer's cache"
    sc.reset_cache()
    tol = tolerance_for(sc.dtype).atol / 100
    torch.testing.assert_close(out, sc.forward(sc.impl(), md), atol=tol, rtol=tol)


def test_layer_outside_forward_context_raises(backend, backend_name, device, model_dtype):
    sc = make_scenario(backend, MIXED, device=device, dtype=model_dtype, seed=71)
    layer = _layer(sc, backend_name, layer_idx=0)
    with pytest.raises(Exception, match="forward_context"):
        layer(sc.query.flatten(1), sc.key.flatten(1), sc.value.flatten(1))


class TinyModel(nn.Module):
    """Two decoder layers: fused qkv projection, paged attention, output projection."""

    def __init__(self, hidden, num_heads, num_kv_heads, head_size, backend_name):
        super().__init__()
        self.dims = (num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size)
        self.qkv = nn.ModuleList(nn.Linear(hidden, sum(self.dims)) for _ in range(2))
        self.o = nn.ModuleList(nn.Linear(num_heads * head_size, hidden) for _ in range(2))
        self.attn = nn.ModuleList(
            pagedattn.Attention(num_heads, head_size, head_size ** -0.5, num_kv_heads,
                                backend=backend_name, layer_idx=i) for i in range(2))

    def forward(self, x):  # x: [T, hidden]
        for qkv, attn, o in zip(self.qkv, self.attn, self.o):
            q, k, v = qkv(x).split(self.dims, dim=-1)
            x = x + o(attn(q, k, v))
        return x


@KERNEL_GRID  # the backend runs inside the registered op, which dynamo does not trace
def test_tiny_model_compiles_fullgraph(backend, backend_name, device, model_dtype):
    sc = make_scenario(backend, MIXED, device=device, dtype=model_dtype, seed=72)
    torch.manual_seed(0)
    model = TinyModel(32, sc.num_heads, sc.num_kv_heads, sc.head_size, backend_name)
    model = model.to(device, sc.dtype).eval()
    x = torch.randn(sc.num_tokens, 32, device=device).to(sc.dtype)
    tol = tolerance_for(sc.dtype)
    md = sc.build()
    eager_caches = [sc.kv_cache.clone(), sc.kv_cache.clone()]
    compiled_caches = [sc.kv_cache.clone(), sc.kv_cache.clone()]
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        with pagedattn.forward_context(md, eager_caches):
            want = model(x)
        with pagedattn.forward_context(md, compiled_caches):
            got = compiled(x)
    # the projections may fuse differently under inductor; attention itself is the same op
    torch.testing.assert_close(got, want, atol=tol.atol, rtol=tol.rtol)
    for a, b in zip(compiled_caches, eager_caches):
        torch.testing.assert_close(a, b, atol=tol.atol, rtol=tol.rtol)
    assert not torch.equal(eager_caches[0], sc.kv_cache), "the model wrote nothing to the cache"


class _RecordOps(TorchDispatchMode):
    """Records every call of an op in the `pagedattn` namespace, with cloned inputs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "pagedattn":
            clone = lambda a: a.clone() if isinstance(a, torch.Tensor) else a  # noqa: E731
            self.calls.append((func, tuple(clone(a) for a in args),
                               {k: clone(v) for k, v in kwargs.items()}))
        return func(*args, **kwargs)


def test_layer_goes_through_the_registered_op(backend, backend_name, device, model_dtype):
    sc = make_scenario(backend, MIXED, device=device, dtype=model_dtype, seed=73)
    layer = _layer(sc, backend_name, layer_idx=0)
    with pagedattn.forward_context(sc.build(), [sc.kv_cache]), _RecordOps() as rec:
        layer(sc.query.flatten(1), sc.key.flatten(1), sc.value.flatten(1))
    assert rec.calls, "Attention.forward did not call a torch.ops.pagedattn op"
    packet = pagedattn.layer.ATTENTION_OP
    assert isinstance(packet, torch._ops.OpOverloadPacket)
    assert {f.overloadpacket for f, _, _ in rec.calls} == {packet}


@KERNEL_GRID  # one op, one schema: the backends differ inside it, which test_layer_equals_impl covers
def test_opcheck(backend, backend_name, device, model_dtype):
    """torch.library.opcheck on the op exactly as the layer calls it (schema, fake, aot)."""
    sc = make_scenario(backend, MIXED, device=device, dtype=model_dtype, seed=74)
    layer = _layer(sc, backend_name, layer_idx=0)
    md = sc.build()
    with pagedattn.forward_context(md, [sc.kv_cache]):
        with _RecordOps() as rec:
            layer(sc.query.flatten(1), sc.key.flatten(1), sc.value.flatten(1))
        assert rec.calls
        for func, args, kwargs in rec.calls:
            sc.reset_cache()
            torch.library.opcheck(func, args, kwargs)
