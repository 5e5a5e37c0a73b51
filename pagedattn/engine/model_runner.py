"""Runs the model on a scheduled step: KV pools, inputs, metadata, CUDA graphs, multi-step.

The KV pool is allocated once: sized from free memory after a profiling run on CUDA
(`gpu_memory_utilization`), from a fixed budget on the CPU, or fixed by `num_kv_blocks`.
On the CPU the model's float32 linears are swapped, in place, for oneDNN-prepacked ones.
Decode-only steps on CUDA replay graphs captured for batch sizes 1, 2, 4, 8, 16, 32, ...
(steps of 16) up to `max_num_seqs`, through the backend's `AttentionState`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from pagedattn.attention.backend import AttentionBackend
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.state import AttentionState
from pagedattn.attention.types import ScheduledSeq
from pagedattn.dtypes import kv_cache_dtype
from pagedattn.engine.config import EngineConfig
from pagedattn.engine.sampler import Sampler, SamplingBatch
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.engine.scheduler import ScheduledChunk, SchedulerOutput
from pagedattn.engine.sequence import SLIDING_FREED
from pagedattn.intmath import cdiv
from pagedattn.layer import forward_context
from pagedattn.models.layers import pack_linears_for_cpu

logger = logging.getLogger(__name__)

_GIB = 1 << 30
_MAX_SWAP_POOL_RATIO = 4  # the CPU swap pool never exceeds this many times the device pool


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    state: AttentionState
    buffers: dict[str, torch.Tensor]


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded, backend: type[AttentionBackend], device: torch.device):
        self.model = loaded.model
        if device.type == "cpu":
            pack_linears_for_cpu(self.model)
        self.spec = loaded.spec
        self.backend = backend
        self.device = device
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.batched_tokens(self.spec.max_model_len)
        lookahead = config.num_scheduler_steps - 1
        self.max_blocks_per_seq = cdiv(self.spec.max_model_len + 1 + lookahead, self.block_size)
        self.builder = backend.get_builder_cls()(
            self.block_size, device, sliding_window=self.spec.builder_sliding_window
        )
        self.cache_dtype = kv_cache_dtype(config.kv_cache_dtype, self.spec.dtype)
        self.default_generator = torch.Generator(device=device).manual_seed(config.seed)
        self.sampler = Sampler(self.default_generator)

        self.num_blocks = self._num_kv_blocks(config)
        shape = backend.get_kv_cache_shape(self.num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_size)
        self.kv_caches = [torch.zeros(shape, dtype=self.cache_dtype, device=device) for _ in range(self.spec.num_layers)]
        self.num_cpu_blocks = self._num_cpu_blocks(config)
        cpu_shape = backend.get_kv_cache_shape(
            self.num_cpu_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_size
        )
        pin = device.type == "cuda"
        # Untouched CPU pages cost nothing until a swap writes them.
        self.cpu_caches = (
            [torch.empty(cpu_shape, dtype=self.cache_dtype, pin_memory=pin) for _ in range(self.spec.num_layers)]
            if self.num_cpu_blocks
            else []
        )
        logger.info(
            "KV cache: %d blocks of %d tokens on %s (%s), %d CPU swap blocks",
            self.num_blocks, self.block_size, device, self.cache_dtype, self.num_cpu_blocks,
        )
        self.graphs: dict[int, _Graph] = {}
        if device.type == "cuda" and not config.enforce_eager:
            self._capture_graphs()

    # ------------------------------------------------------------------ sizing

    def _block_bytes(self) -> int:
        per_block = math.prod(
            self.backend.get_kv_cache_shape(1, self.block_size, self.spec.num_kv_heads, self.spec.head_size)
        )
        return per_block * self.cache_dtype.itemsize * self.spec.num_layers

    def _num_kv_blocks(self, config: EngineConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if self.device.type == "cuda":
            free = self._profile_free_bytes(config.gpu_memory_utilization)
            num = int(free // self._block_bytes())
            if num < 1:
                raise RuntimeError(
                    f"expected room for KV-cache blocks after loading the model, got {free / _GIB:.2f} GiB "
                    f"at gpu_memory_utilization={config.gpu_memory_utilization}; raise it or lower max_num_batched_tokens"
                )
            return num
        # The CPU budget; more blocks than max_num_seqs full-length sequences would never be used.
        num = int(config.cpu_kv_cache_gib * _GIB // self._block_bytes())
        return max(1, min(num, self.max_num_seqs * self.max_blocks_per_seq))

    def _num_cpu_blocks(self, config: EngineConfig) -> int:
        if config.preemption_mode == "recompute":
            return 0
        num = int(config.swap_space_gib * _GIB // self._block_bytes())
        return min(num, _MAX_SWAP_POOL_RATIO * self.num_blocks)

    @torch.inference_mode()
    def _profile_free_bytes(self, utilization: float) -> float:
        """Run the largest step (with an empty cache) and the sampler on the most rows; what the
        device has left under `utilization`, keeping that step's transient peak free."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        seqs, positions = [], []
        tokens = self.max_num_batched_tokens
        while tokens > 0:
            n = min(tokens, self.spec.max_model_len)
            seqs.append(ScheduledSeq(n, n, [0] * cdiv(n, self.block_size)))
            positions += range(n)
            tokens -= n
        ids = torch.zeros(len(positions), dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        md = self.builder.build(seqs)
        empty = [torch.empty(0, dtype=self.cache_dtype, device=self.device)] * self.spec.num_layers
        with forward_context(md, empty):
            hidden = self.model(ids, pos)
        rows = min(self.max_num_seqs, hidden.shape[0])
        logits = self.model.compute_logits(hidden[-rows:])
        params = SamplingParams(temperature=1.0, top_k=2, top_p=0.5)
        self.sampler.sample(logits, SamplingBatch.build([(params, None)] * rows, logits.shape[1], self.device))
        torch.cuda.synchronize(self.device)
        del hidden, logits
        stats = torch.cuda.memory_stats(self.device)
        transient = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
        free, total = torch.cuda.mem_get_info(self.device)
        return total * utilization - (total - free) - transient

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Move blocks, run the step, and return the logits of its sampled rows: float32
        [num sampled chunks, vocab], in chunk order (None when nothing ran)."""
        self._move_blocks(out)
        if not out.chunks:
            return None
        ids, pos, sample_idx, seqs = self._prepare(out.chunks)
        decode_only = not any(c.is_prefill for c in out.chunks)
        pad_to = self._graph_size(len(seqs)) if decode_only else None
        md = self.builder.build(seqs, cuda_graph_pad_to=pad_to)
        hidden = self._run(md, ids, pos, pad_to)
        return self.model.compute_logits(hidden.index_select(0, sample_idx))

    @torch.inference_mode()
    def execute_multistep(self, out: SchedulerOutput, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `out.num_steps` decode steps of a decode-only batch, sampling on the device and
        advancing the metadata in place between them. Returns token ids int64 [steps, B] and
        their logprobs float32 [steps, B]."""
        self._move_blocks(out)
        ids, pos, _, seqs = self._prepare(out.chunks)
        n = len(seqs)
        pad_to = self._graph_size(n)
        if pad_to is not None and pad_to > n:  # advance_step reads every row of the batch
            ids = torch.cat([ids, ids.new_zeros(pad_to - n)])
            pos = torch.cat([pos, pos.new_zeros(pad_to - n)])
        md = self.builder.build(seqs, cuda_graph_pad_to=pad_to)
        tokens, logprobs = [], []
        for step in range(out.num_steps):
            if step:
                md.advance_step(ids, pos, tokens[-1].unsqueeze(1), self.block_size, md.num_seqs, n)
            hidden = self._run(md, ids, pos, pad_to)[:n]
            t, lp = self.sampler.sample(self.model.compute_logits(hidden), batch)
            tokens.append(t)
            logprobs.append(lp)
        return torch.stack(tokens), torch.stack(logprobs)

    def _move_blocks(self, out: SchedulerOutput) -> None:
        # Order matters: swapped-out blocks may be reused by swap-ins and copies of this step.
        if out.swap_out:
            mapping = torch.tensor(out.swap_out, dtype=torch.int64)
            for gpu, cpu in zip(self.kv_caches, self.cpu_caches):
                self.backend.swap_blocks(gpu, cpu, mapping)
        if out.swap_in:
            mapping = torch.tensor(out.swap_in, dtype=torch.int64)
            for gpu, cpu in zip(self.kv_caches, self.cpu_caches):
                self.backend.swap_blocks(cpu, gpu, mapping)
        if out.copies:
            self.backend.copy_blocks(self.kv_caches, torch.tensor(out.copies, dtype=torch.int64).to(self.device))

    def _prepare(self, chunks: list[ScheduledChunk]):
        """Input ids and positions int64 [T], sampled-row indices int64 [S] (one H2D copy), and
        the step's `[ScheduledSeq]`."""
        ids: list[int] = []
        positions: list[int] = []
        sample_idx: list[int] = []
        seqs = []
        for c in chunks:
            seq = c.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + c.num_tokens
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            if c.sample:
                sample_idx.append(len(ids) - 1)
            # Blocks freed by the sliding window are never read (the builder drops them).
            table = [0 if b == SLIDING_FREED else b for b in seq.block_table]
            seqs.append(ScheduledSeq(seq_len=end, query_len=c.num_tokens, block_table=table))
        flat = torch.tensor(ids + positions + sample_idx, dtype=torch.int64)
        if self.device.type == "cuda":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        t = len(ids)
        return flat[:t], flat[t : 2 * t], flat[2 * t :], seqs

    def _run(self, md: AttentionMetadata, ids: torch.Tensor, pos: torch.Tensor, pad_to: int | None) -> torch.Tensor:
        """hidden [T, H] (graph padding rows included when replayed)."""
        if pad_to is None:
            with forward_context(md, self.kv_caches):
                return self.model(ids, pos)
        g = self.graphs[pad_to]
        g.state.prepare_graph_input_buffers(g.buffers, md)
        g.state.begin_forward(md)
        n = ids.shape[0]
        self._graph_ids[:n].copy_(ids)
        self._graph_pos[:n].copy_(pos)
        self._graph_ids[n:pad_to].zero_()
        self._graph_pos[n:pad_to].zero_()
        g.graph.replay()
        return self._graph_out[:pad_to]

    # ------------------------------------------------------------------ CUDA graphs

    def _graph_size(self, batch_size: int) -> int | None:
        """The smallest captured batch size that holds `batch_size` sequences, or None (eager)."""
        return min((s for s in self.graphs if s >= batch_size), default=None)

    def _capture_graphs(self) -> None:
        max_bs = self.max_num_seqs
        sizes = sorted({s for s in [1, 2, 4, 8, *range(16, max_bs + 1, 16)] if s <= max_bs} | {max_bs})
        self._graph_ids = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        self._graph_pos = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        self._graph_out = torch.zeros(max_bs, self.spec.hidden_size, dtype=self.spec.dtype, device=self.device)
        state = self.backend.get_state_cls()(max_bs, self.max_blocks_per_seq, self.block_size, self.device)
        pool = None
        with torch.inference_mode(), state.graph_capture(max_bs):
            for bs in reversed(sizes):  # largest first, so smaller graphs reuse its memory pool
                md = state.graph_capture_get_metadata_for_batch(bs)
                graph_state = state.graph_clone(bs)
                graph_state.begin_forward(md)
                ids, pos = self._graph_ids[:bs], self._graph_pos[:bs]
                with forward_context(md, self.kv_caches):
                    self._graph_out[:bs] = self.model(ids, pos)  # warm-up outside the graph
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._graph_out[:bs] = self.model(ids, pos)
                pool = graph.pool() if pool is None else pool
                self.graphs[bs] = _Graph(graph, graph_state, graph_state.get_graph_input_buffers(md))
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for decode batch sizes %s", sizes)
