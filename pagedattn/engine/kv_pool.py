"""`KVPoolSizer`: how many blocks a model runner's KV pool (and its CPU swap pool) holds.

The device pool is `num_kv_blocks` as given, or sized from memory: on CUDA what is left under
`gpu_memory_utilization` once the largest step has run on empty caches (its transient peak kept
free) and room is kept for the decode CUDA graphs; on the CPU a fixed budget
(`cpu_kv_cache_gib`). A pool that cannot hold one request of the whole context is refused, as
vLLM does, naming the knob to turn. The swap pool holds `swap_space_gib`, at most
`_MAX_SWAP_POOL_RATIO` times the device pool.
"""

from __future__ import annotations

import logging
import math

import torch

from pagedattn.attention.types import ScheduledSeq
from pagedattn.engine.config import EngineConfig
from pagedattn.engine.decode_graphs import DecodeGraphs
from pagedattn.engine.sampler import SamplingBatch
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.intmath import cdiv

logger = logging.getLogger(__name__)

GIB = 1 << 30
_MAX_SWAP_POOL_RATIO = 4  # the CPU swap pool never exceeds this many times the device pool
# The decode graphs' shared pool holds the largest graph's activations and float32 logits
# [max_num_seqs, vocab]; the eager decode step measured at profiling is that, and each captured
# graph adds its own executable state: kept free beside the KV pool with this much room.
_GRAPH_POOL_MARGIN = 1.1
_GRAPH_BYTES_EACH = 2 << 20


class KVPoolSizer:
    """Sizes the pools of `runner` (a `ModelRunner` being built: its model, builder and sampler
    run the profiled steps, before its caches exist). `graph_reserve`: the bytes kept free for
    the decode graphs, once a profile has measured them (0 before, or without graphs)."""

    def __init__(self, runner):
        self.runner = runner
        self.graph_reserve = 0

    def block_bytes(self) -> int:
        """Bytes of one block id: its K/V in every cache tensor of the pool."""
        r = self.runner
        shape = r.backend.get_kv_cache_shape(1, r.block_size, r.num_kv_heads, r.spec.head_size)
        return math.prod(shape) * r.cache_dtype.itemsize * r.num_caches

    def num_kv_blocks(self, config: EngineConfig) -> int:
        """The pool's blocks: `num_kv_blocks` as given (tests shrink it on purpose), else sized
        from memory (with tensor parallelism, the fewest any rank can hold: the block manager's
        ids name a block in every rank's pool) and refused, as vLLM does, when one request of
        the whole context cannot fit. Ranks return from here together: a rank that failed to
        load its shard fails every rank's start-up."""
        r = self.runner
        per_request = r.kv_groups.blocks_per_request(r.max_blocks_per_seq * r.block_size, r.block_size,
                                                     r.max_num_batched_tokens)
        if config.num_kv_blocks is not None:
            if config.num_kv_blocks < per_request:
                logger.warning(
                    "num_kv_blocks=%d holds fewer tokens (%d) than one request of max_model_len=%d",
                    config.num_kv_blocks, config.num_kv_blocks * r.block_size, r.spec.max_model_len,
                )
            # every rank's, so the same; the collective makes start-up wait for every rank's model
            return r.tp.min(config.num_kv_blocks)
        if r.device.type == "cuda":
            free = self.profile_free_bytes(config.gpu_memory_utilization)
            num = int(free // self.block_bytes())
            budget = f"{max(free, 0) / GIB:.2f} GiB free at gpu_memory_utilization={config.gpu_memory_utilization}"
            raise_hint = "raise gpu_memory_utilization (--gpu-memory-utilization)"
        else:
            # The CPU budget; more blocks than max_num_seqs full-length sequences would never be used.
            num = int(config.cpu_kv_cache_gib * GIB // self.block_bytes())
            num = min(num, r.max_num_seqs * per_request)
            budget = f"the CPU budget of {config.cpu_kv_cache_gib} GiB"
            raise_hint = f"set num_kv_blocks (--num-kv-blocks) to at least {per_request}"
        num = r.tp.min(max(num, 0))
        if r.tp.size > 1:
            budget += f" on rank {r.tp.rank} (the pool has the fewest blocks any of {r.tp.size} ranks holds)"
        if num < per_request:
            raise ValueError(
                f"expected the KV pool to hold one request of max_model_len={r.spec.max_model_len} tokens "
                f"({per_request} blocks of {r.block_size}), got {num} blocks "
                f"({num * r.block_size} tokens, {self.block_bytes()} bytes a block) in {budget}; "
                f"{raise_hint}, or lower max_model_len (--max-model-len)"
            )
        return num

    def num_cpu_blocks(self, config: EngineConfig, num_blocks: int) -> int:
        """The swap pool's blocks beside a device pool of `num_blocks` (0 when preemption recomputes)."""
        if config.preemption_mode == "recompute":
            return 0
        num = int(config.swap_space_gib * GIB // self.block_bytes())
        return min(num, _MAX_SWAP_POOL_RATIO * num_blocks)

    @torch.inference_mode()
    def profile_free_bytes(self, utilization: float) -> float:
        """Run the largest step (with an empty cache) and the sampler on the most rows; what the
        device has left under `utilization`, keeping that step's transient peak free."""
        r = self.runner
        device = r.device
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        seqs, positions, encoder_positions = [], [], []
        tokens = r.max_num_batched_tokens
        while tokens > 0:
            n = min(tokens, r.spec.max_model_len)
            # Encoder-decoder: the same tokens again through the encoder (its worst case too);
            # an audio request's encoder runs on a whole window, whatever its decoder's length.
            e = min(n, r.spec.max_encoder_len)
            if r.audio is not None:
                e = r.audio.num_positions(r.audio.max_frames)
            seqs.append(ScheduledSeq(n, n, [0] * cdiv(n, r.block_size), encoder_len=e))
            positions += range(n)
            encoder_positions += range(e)
            tokens -= n
        ids = torch.zeros(len(positions), dtype=torch.int64, device=device)
        pos = torch.tensor(positions, dtype=torch.int64, device=device)
        encoder = None
        if r.spec.num_cross_layers:
            encoder_pos = torch.tensor(encoder_positions, dtype=torch.int64, device=device)
            encoder = (torch.zeros_like(encoder_pos), encoder_pos)
            if r.audio is not None:
                window = (r.audio.num_mel_bins, r.audio.max_frames)
                encoder = ([torch.zeros(window, device=device) for _ in seqs], encoder_pos)
        md = r.builder.build(seqs)
        empty = [torch.empty(0, dtype=r.cache_dtype, device=device)] * len(r.builder.layer_group)
        with md.context(empty):
            hidden = r.forward_model(ids, pos, encoder)
        rows = min(r.max_num_seqs, hidden.shape[0])
        logits = r.model.compute_logits(hidden[-rows:])
        params = SamplingParams(temperature=1.0, top_k=2, top_p=0.5)
        r.sampler.sample(logits, SamplingBatch.build([(params, None)] * rows, logits.shape[1], device))
        torch.cuda.synchronize(device)
        del hidden, logits
        stats = torch.cuda.memory_stats(device)
        transient = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
        self.graph_reserve = self.decode_graph_bytes() if r.use_graphs else 0
        free, total = torch.cuda.mem_get_info(device)
        return total * utilization - (total - free) - transient - self.graph_reserve

    def decode_graph_bytes(self) -> int:
        """What the decode graphs will hold: the eager decode step of `max_num_seqs` sequences
        (model and output head, empty cache) measured, with room for each graph's own state."""
        r = self.runner
        device = r.device
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        seqs = [ScheduledSeq(1, 1, [0])] * r.max_num_seqs
        ids = torch.zeros(r.max_num_seqs, dtype=torch.int64, device=device)
        md = r.builder.build(seqs)
        empty = [torch.empty(0, dtype=r.cache_dtype, device=device)] * len(r.builder.layer_group)
        with md.context(empty):
            logits = r.model.compute_logits(r.forward_model(ids, torch.zeros_like(ids), None))
        torch.cuda.synchronize(device)
        del logits
        peak = torch.cuda.max_memory_allocated(device) - base
        # two context classes at most, and the cascade graphs
        num_graphs = (2 + r.cascade_graphs) * len(DecodeGraphs.batch_sizes(r.max_num_seqs))
        return int(peak * _GRAPH_POOL_MARGIN) + num_graphs * _GRAPH_BYTES_EACH
