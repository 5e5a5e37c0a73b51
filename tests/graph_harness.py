"""The one CUDA-graph capture/replay protocol of the tests.

`capture(step)` records any step (a kernel launch, an `impl.forward`) after warm-up calls on a
side stream: they compile kernels and allocate lazily made scratch outside the graph, as
`torch.cuda.graph` requires. `DecodeGraph` is one captured decode step of a backend, following
API.md section 5 as the engine's runner does: inside `state.graph_capture`, the capture
metadata for the batch size, a per-graph clone of the state, and the graph's input buffers;
before each replay, `prepare_graph_input_buffers(buffers, real_md)` and
`begin_forward(real_md)` on that clone.
"""

from __future__ import annotations

from typing import Callable

import torch


def capture(step: Callable[[], object], *, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """A graph of `step()` (which reads and writes only persistent tensors)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


class DecodeGraph:
    """One decode step of `batch_size` rows of one attention layer, captured over `state`.

    Build it inside `with state.graph_capture(max_batch_size):`. `kv_cache` is the layer's
    cache (the graph writes the real rows' K/V into it on replay); `k_scale`/`v_scale` are
    floats or 0-dim float32 device tensors the graph reads on every replay.
    """

    def __init__(self, state, impl, kv_cache: torch.Tensor, batch_size: int, *, num_heads: int,
                 num_kv_heads: int, head_size: int, dtype: torch.dtype, k_scale=1.0,
                 v_scale=1.0):
        dev = kv_cache.device
        self.md = state.graph_capture_get_metadata_for_batch(batch_size)
        self.state = state.graph_clone(batch_size)
        self.state.begin_forward(self.md)
        self.buffers = self.state.get_graph_input_buffers(self.md)
        self.query = torch.zeros(batch_size, num_heads * head_size, dtype=dtype, device=dev)
        self.key = torch.zeros(batch_size, num_kv_heads * head_size, dtype=dtype, device=dev)
        self.value = torch.zeros_like(self.key)
        self.out = torch.empty_like(self.query)  # [batch_size, Hq*D]
        self.impl, self.kv_cache = impl, kv_cache
        self.k_scale, self.v_scale = k_scale, v_scale
        self.graph = capture(self._step)

    def _step(self) -> None:
        self.impl.forward(self.query, self.key, self.value, self.kv_cache, self.md,
                          self.k_scale, self.v_scale, output=self.out)

    def replay(self, real_md, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor) -> torch.Tensor:
        """Runs the graph on the real step: `real_md` built with `cuda_graph_pad_to` equal to
        the graph's batch size; query [n, Hq(*D)...], key/value [n, Hkv(*D)...] for the n real
        sequences. Returns out[:n] ([n, Hq*D], a view of the graph's output buffer); rows the
        graph left unwritten read NaN."""
        self.state.prepare_graph_input_buffers(self.buffers, real_md)
        self.state.begin_forward(real_md)
        n = query.shape[0]
        self.query[:n].copy_(query.flatten(1))
        self.key[:n].copy_(key.flatten(1))
        self.value[:n].copy_(value.flatten(1))
        self.out.fill_(float("nan"))
        self.graph.replay()
        return self.out[:n]
