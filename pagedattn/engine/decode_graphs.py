"""CUDA graphs of decode steps: the model and its output head, per batch size and context class.

Sizes 1, 2, 4, 8, 16, 32, ... (steps of 16) up to `max_num_seqs` are captured, largest first,
sharing one memory pool, through the backend's `AttentionState`, twice: for any context (the
capture metadata's `max_decode_seq_len` is the block table's room) and for steps whose longest
context is at most SHORT_CONTEXT tokens. A kernel plans its launch from that host int at
capture (the `triton` backend: key tiles and split-KV count); a graph planned for any length
runs short contexts, an engine's usual early steps, slower (docs/PERF.md). A model in several KV
cache groups has a state per group (`engine/step_metadata.py`): each graph reads every group's
buffers, each group's layers their own.

Cascade graphs (`cascade_min_seqs=n`): a third family, one graph per batch size for any context
that can serve a cascaded step (the policy cascades `n` sequences or more: sizes below the one
that holds `n` would never replay, and each captured size compiles launches of its own), whose
full-attention groups' layers attend a shared prefix apart (`engine/cascade.py`): each group's
suffixes through its state's buffers, the prefix through shared-prefix metadata captured over
the longest prefix a table holds (`build_shared_prefix`), whose lengths and blocks are copied in
before each replay. Backends whose states say they cannot (`AttentionState.shared_prefix_graphs`)
have none.

A graph runs the model on its input-id and position buffers and then `compute_logits`, so a
replayed step hands the sampler float32 logits [batch, vocab] with no launch of its own in
between (the output head reads as many bytes as a tenth of an 8B model's layers: outside the
graph its launch gaps showed). Every graph writes its logits into one float32 buffer
[max_num_seqs, vocab] (`compute_logits(..., out=)`), not into a tensor of its own in the pool:
held per graph, those outputs summed to 16 GiB per context class at max_num_seqs 1000 with a
128k vocabulary. The buffer holds a replay's logits until the next replay; the sampler's
kernels, queued behind the replay on the same stream, read them first.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from dataclasses import dataclass, replace

import torch

from pagedattn.attention.backend import AttentionBackend
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.state import AttentionState
from pagedattn.cuda_timing import median_event_ms
from pagedattn.engine.step_metadata import GroupedMetadataBuilder, StepMetadata, group_impls

logger = logging.getLogger(__name__)

SHORT_CONTEXT = 256  # the short class's bound on a step's longest context, in tokens


CASCADE = "cascade"  # the context class of the cascade graphs


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    states: list[AttentionState]  # per KV cache group
    buffers: list[dict[str, torch.Tensor]]  # per KV cache group
    logits: torch.Tensor  # float32 [batch size, vocab]: rows of the shared buffer, rewritten by each replay
    prefixes: list[AttentionMetadata | None] | None = None  # a cascade graph's shared prefix per group (else None)


class DecodeGraphs:
    """`logits(md, ids, pos)` replays the graph of the step's padded batch size (`size_for`)."""

    def __init__(self, model, backend: type[AttentionBackend], builder: GroupedMetadataBuilder,
                 kv_caches: list[torch.Tensor], *, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, cascade_min_seqs: int | None = None):
        """builder: the engine's, for its KV cache groups (a state each) and which layers read each.
        cascade_min_seqs: also capture cascade graphs, for batches of at least this many sequences
        (`has_cascade` says whether the backend's states could)."""
        self.model = model
        self.builder = builder
        self.max_blocks_per_seq = max_blocks_per_seq
        self.kv_caches = kv_caches
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.sizes = sorted({s for s in [1, 2, 4, 8, *range(16, max_num_seqs + 1, 16)] if s <= max_num_seqs}
                            | {max_num_seqs})
        # Context classes: None (any length), then the short one where the table holds more.
        self.classes = [None] + ([SHORT_CONTEXT] if max_blocks_per_seq * block_size > SHORT_CONTEXT else [])
        self._last: tuple[int | None, int] | None = None  # the (class, size) replayed last
        self._ids = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self._pos = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self._graphs: dict[tuple[int | None, int], _Graph] = {}
        self._logits: torch.Tensor | None = None  # float32 [max_num_seqs, vocab], every graph's output
        self.layer_group = builder.layer_group
        states = []
        for impls in group_impls(model, builder.layer_group, len(builder.builders)):
            states.append(backend.get_state_cls()(max_num_seqs, max_blocks_per_seq, block_size, device))
            states[-1].set_layers(impls)
        smallest = None if cascade_min_seqs is None else self.size_for(cascade_min_seqs)
        self.has_cascade = smallest is not None and all(state.shared_prefix_graphs for state in states)
        self.cascade_sizes = [s for s in self.sizes if s >= smallest] if self.has_cascade else []
        if self.has_cascade:
            self.classes.append(CASCADE)
        # No garbage collection inside a capture: a cycle collected there (an old engine: its
        # graphs, pinned buffers, events) frees CUDA resources, which invalidates the capture
        # (seen as CUBLAS_STATUS_INTERNAL_ERROR); PyTorch's `torch.cuda.graph` no longer collects.
        gc.collect()
        torch.cuda.empty_cache()
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._capture(states)
        finally:
            if collecting:
                gc.enable()
        torch.cuda.synchronize(device)
        logger.info("captured CUDA graphs for decode batch sizes %s, contexts %s", self.sizes,
                    " and ".join("any" if c is None else f"<= {c}" for c in self.classes))

    def _capture(self, states: list[AttentionState]) -> None:
        pool = None
        with torch.inference_mode(), contextlib.ExitStack() as capturing:
            for state in states:
                capturing.enter_context(state.graph_capture(self.max_num_seqs))
            shapes = [(c, s) for c in self.classes for s in reversed(self.cascade_sizes if c == CASCADE else self.sizes)]
            for limit, bs in shapes:
                # largest first, so smaller graphs reuse its memory pool
                mds = [state.graph_capture_get_metadata_for_batch(bs) for state in states]
                if limit not in (None, CASCADE):
                    mds = [replace(md, max_decode_seq_len=limit) for md in mds]
                graph_states = [state.graph_clone(bs) for state in states]
                for graph_state, md in zip(graph_states, mds):
                    graph_state.begin_forward(md)
                ids, pos = self._ids[:bs], self._pos[:bs]
                step = StepMetadata(mds, self.layer_group)
                if limit == CASCADE:
                    step = StepMetadata(mds, self.layer_group, self._capture_prefixes(bs), self.builder.cascade_layers)
                with step.context(self.kv_caches):
                    warm = self.model.compute_logits(self.model(ids, pos))  # warm-up outside the graph
                    if self._logits is None:  # the largest size comes first
                        self._logits = torch.empty(self.max_num_seqs, warm.shape[1], dtype=torch.float32,
                                                   device=self.device)
                    del warm
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        logits = self.model.compute_logits(self.model(ids, pos), out=self._logits[:bs])
                pool = graph.pool() if pool is None else pool
                buffers = [gs.get_graph_input_buffers(md) for gs, md in zip(graph_states, mds)]
                self._graphs[limit, bs] = _Graph(graph, graph_states, buffers, logits, step.shared_prefix)

    def _capture_prefixes(self, batch_size: int) -> list[AttentionMetadata | None]:
        """Each full-attention group's shared-prefix metadata for capture: `batch_size` queries over
        the most blocks a table holds (kernels plan their launches for that length), marked as a
        graph's (its tensors are rewritten before each replay)."""
        return [None if b.sliding_window is not None else
                replace(b.build_shared_prefix(batch_size, [0] * self.max_blocks_per_seq), use_cuda_graph=True)
                for b in self.builder.builders]

    @staticmethod
    def batch_sizes(max_num_seqs: int) -> list[int]:
        """The captured batch sizes: 1, 2, 4, 8, then steps of 16, and `max_num_seqs`."""
        return sorted({s for s in [1, 2, 4, 8, *range(16, max_num_seqs + 1, 16)] if s <= max_num_seqs}
                      | {max_num_seqs})

    def size_for(self, batch_size: int) -> int | None:
        """The smallest captured batch size that holds `batch_size` sequences, or None (eager)."""
        return min((s for s in self.sizes if s >= batch_size), default=None)

    def logits(self, md: StepMetadata, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """float32 [pad_to, vocab] for a decode-only step padded to a captured size (`md.num_seqs`);
        rows past `ids.shape[0]` are the padding's."""
        pad_to = md.num_seqs
        if not self._graphs:
            raise RuntimeError("expected captured decode graphs, got none: they were released (`release`, at the "
                               "engine's shutdown)")
        short = SHORT_CONTEXT in self.classes and md.max_decode_seq_len <= SHORT_CONTEXT
        if md.shared_prefix is not None:
            if (CASCADE, pad_to) not in self._graphs:
                raise ValueError(f"expected a step without a shared prefix: no cascade graph was captured for "
                                 f"{pad_to} sequences (cascade graphs: {self.cascade_sizes})")
            self._last = (CASCADE, pad_to)
        else:
            self._last = (SHORT_CONTEXT if short else None, pad_to)
        g = self._graphs[self._last]
        for state, buffers, group_md in zip(g.states, g.buffers, md.groups):
            state.prepare_graph_input_buffers(buffers, group_md)
            state.begin_forward(group_md)
        for captured, real in zip(g.prefixes or (), md.shared_prefix or ()):
            if captured is not None:
                _copy_shared_prefix(captured, real)
        n = ids.shape[0]
        self._ids[:n].copy_(ids)
        self._pos[:n].copy_(pos)
        self._ids[n:pad_to].zero_()
        self._pos[n:pad_to].zero_()
        g.graph.replay()
        return g.logits

    def release(self) -> None:
        """Destroy every captured graph (no replay after it). Tensor parallelism needs it before
        its process groups are left: NCCL's communicator teardown (destroy or abort) waits until
        every CUDA graph that captured one of its collectives is destroyed (each holds a
        reference on the communicator; NCCL's `commDestroySync`, pytorch/pytorch#115388), and the
        decode graphs capture the output head's gather."""
        for g in self._graphs.values():
            g.graph.reset()
        self._graphs.clear()
        self._last = None
        torch.cuda.synchronize(self.device)

    def time_replay(self, batch_size: int, reps: int = 20) -> float | None:
        """Device seconds of one replay of the graph that serves `batch_size` decodes (the model and
        its output head, without sampling or host work), of the context class the last step
        replayed: the median of `reps` timed back to back, its inputs as the last step left them;
        None when no graph holds the batch. It rewrites the K/V slots that step wrote, with the
        same values: call it between steps of running requests."""
        size = self.size_for(batch_size)
        if size is None:
            return None
        graph = self._graphs[self._last[0] if self._last else None, size].graph
        return median_event_ms(graph.replay, reps, warmup=0) / 1e3


def _copy_shared_prefix(captured: AttentionMetadata, real: AttentionMetadata) -> None:
    """A step's shared prefix (`build_shared_prefix`) into a cascade graph's (its lengths, its
    blocks: the graph's table is the longest, its tail left as it is: never read)."""
    n = real.cross_block_tables.shape[1]
    captured.cross_block_tables[:, :n].copy_(real.cross_block_tables, non_blocking=True)
    captured.encoder_seq_lens_tensor.copy_(real.encoder_seq_lens_tensor, non_blocking=True)
    captured.encoder_seq_start_loc.copy_(real.encoder_seq_start_loc, non_blocking=True)
