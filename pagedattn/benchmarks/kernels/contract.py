"""A registered backend through the public contract (API.md): `impl.forward(q, k, v, kv_cache,
md, k_scale, v_scale, output=out)`, which stores the step's K/V and attends, over metadata from
the backend's own builder and its cache layout (a view of the shared pools where the layout
allows, else a copy of the same values).

Graph-timed cases (decode) capture as the engine does (API.md section 5): capture metadata
from `state.graph_capture_get_metadata_for_batch(B)` on a per-size clone of the state, the real
step copied in by `prepare_graph_input_buffers` and planned by `begin_forward` once, before
capture. Other cases run on `builder.build(seqs)` metadata, eagerly.
"""

from __future__ import annotations

import pagedattn
from pagedattn.benchmarks.backends import TORCH_MAX_KEYS

from .step import NotApplicable, Step
from .workload import DTYPE, Workload, backend_cache


def prepare_contract(name: str, w: Workload, graph: bool) -> Step:
    """Backend `name` on workload `w` (raises BackendUnavailableError, NotApplicable, or the
    backend's own refusal at construction)."""
    c = w.case
    backend = pagedattn.get_backend(name)
    if not c.paged:
        raise NotApplicable("the contract attends over the cache: ragged rows are raw only")
    keys = sum(c.seq_lens)
    if name == "torch" and keys > TORCH_MAX_KEYS:
        raise NotApplicable(f"{keys} keys > {TORCH_MAX_KEYS}: the reference gathers them all to float32")
    impl = backend.get_impl_cls()(
        c.num_heads, c.head_size, w.scale, c.num_kv_heads, alibi_slopes=w.alibi_slopes,
        sliding_window=c.sliding_window, kv_cache_dtype=c.kv_dtype if c.fp8 else "auto",
        logits_soft_cap=c.soft_cap)
    impl.set_query_dtype(DTYPE)
    caches = [backend_cache(backend, s, w) for s in w.sets]
    builder = backend.get_builder_cls()(c.block_size, w.device)
    builder.set_layers([impl])
    seqs = w.scheduled()
    keep: list = [impl, caches, builder]
    md, note = None, ""
    if graph:
        try:
            md = _graph_metadata(backend, impl, builder, w, keep)
        except Exception as exc:  # noqa: BLE001 - time it eagerly rather than not at all
            note = f"no graph metadata ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if md is None:
        md = builder.build(seqs)
    keep.append(md)
    t = c.num_tokens

    def call(i: int) -> None:
        s = w.sets[i]
        impl.forward(s.query.view(t, -1), s.key.view(t, -1), s.value.view(t, -1), caches[i], md,
                     k_scale=w.k_scale, v_scale=w.v_scale, output=s.out.view(t, -1))

    return Step([lambda i=i: call(i) for i in range(len(w.sets))], lambda: w.sets[0].out,
                store="impl.forward", note=note, eager_only=bool(note), keep=keep)


def _graph_metadata(backend, impl, builder, w: Workload, keep: list):
    """Capture metadata of a decode step over a per-size clone of the backend's state, holding
    the real step (copied in and planned); the state objects go to `keep`."""
    c = w.case
    b, width = c.num_seqs, w.block_tables.shape[1]
    state = backend.get_state_cls()(b, width, c.block_size, w.device)
    state.set_layers([impl])
    with state.graph_capture(b):
        md = state.graph_capture_get_metadata_for_batch(b)
        clone = state.graph_clone(b)
        clone.begin_forward(md)
        buffers = clone.get_graph_input_buffers(md)
    real = builder.build(w.scheduled(), cuda_graph_pad_to=b)
    clone.prepare_graph_input_buffers(buffers, real)
    clone.begin_forward(real)
    keep += [state, clone, buffers, real]
    return md
