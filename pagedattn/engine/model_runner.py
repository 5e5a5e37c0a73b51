"""Runs the model on a scheduled step: KV pools, inputs, metadata, CUDA graphs, sampling, multi-step.

The KV pool is allocated once, sized by `KVPoolSizer` (engine/kv_pool.py): from free memory
after a profiling run on CUDA (`gpu_memory_utilization`), from a fixed budget on the CPU, or
fixed by `num_kv_blocks`.
On the CPU the model's float32 linears are swapped, in place, for oneDNN-prepacked ones.
Decode-only steps on CUDA replay graphs of the model and its output head (`DecodeGraphs`).
`launch` queues a step and returns a `LaunchedStep`, whose `results()` are what it sampled
(`StepResult`): tokens and log-probabilities (with the top-k of rows that ask), the full
log-probabilities of beam-search rows, which the beam step scores itself, and the prompt
log-probabilities of requests that ask (`SamplingParams.prompt_logprobs`): those positions'
hidden states go through the output head too, only for those requests. A step launched
`after` another reads its input tokens from that one's draws on the device (async
scheduling); the sampler then counts each row's last token (penalties, min_tokens) from there.

Tensor parallelism (`tp` of several ranks): every rank runs a `ModelRunner` over its shard of
the model and its own KV pool (its KV heads), built the same way in the same order (profile,
warm-up, graph capture: their collectives pair up), with the pool's block count the smallest
any rank can hold. Rank 0 `launch`es steps: it sends each step's `StepPlan` to the others once
(`send`), then runs its share and samples; the others `execute` the same plan. Calls that run
the model on every rank (`execute`, `time_decode_graph`, `time_all_reduce`) are `WORKER_CALLS`.

Models that mix windowed and full layers keep their layers in KV cache groups
(`engine/kv_cache_groups.py`): layers of different groups share cache tensors, each group has
its own block tables, and a step's metadata is built per group (`engine/step_metadata.py`);
a `StepPlan` carries every group's tables.

Cascade attention (`engine/cascade.py`): where `CascadePolicy` finds a shared prefix in a step
(on rank 0, carried in its plan as `cascade_blocks`), the step's layers that can split attend it
once for all queries and their sequences' suffixes apart; decode steps replay cascade graphs
(`DecodeGraphs(cascade_min_seqs=...)`) where the backend's graph state can hold a shared part.

Encoder-decoder models (`spec.num_cross_layers > 0`) have a cross pool too: one cache tensor
per cross-attention layer, with as many blocks as the decoder pool (a request's encoder
prompt is bounded like its decoder tokens), in the same backend layout. The forward
context's caches are the decoder layers' then the cross layers'. A step's encoder inputs are
the encoder prompts of its prefills, in chunk order: token ids, or an audio encoder's
log-mel features (`loaded.audio` set), one tensor per prefill. Their decode steps run
eagerly: the graph states' metadata carry no cross tables.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from pagedattn.attention.backend import AttentionBackend
from pagedattn.dtypes import kv_cache_dtype
from pagedattn.engine.cascade import CascadePolicy
from pagedattn.engine.config import EngineConfig
from pagedattn.engine.decode_graphs import DecodeGraphs
from pagedattn.engine.kv_cache_groups import KVCacheGroups
from pagedattn.engine.kv_pool import GIB, KVPoolSizer
from pagedattn.engine.launched_step import LaunchedStep
from pagedattn.engine.logprobs import PromptPlan, TopLogprobs
from pagedattn.engine.sampler import Sampler, SamplingBatch
from pagedattn.engine.scheduler import ScheduledChunk, SchedulerOutput
from pagedattn.engine.step_metadata import GroupedMetadataBuilder, StepMetadata
from pagedattn.engine.step_plan import StepPlan
from pagedattn.engine.warmup import warmup_steps
from pagedattn.intmath import cdiv
from pagedattn.layer import Attention, kv_scale_calibration_paused
from pagedattn.models.layers import pack_linears_for_cpu
from pagedattn.parallel.group import TPGroup, time_all_reduce
from pagedattn.parallel.layers import SINGLE, local_heads

logger = logging.getLogger(__name__)

WORKER_CALLS = frozenset({"execute", "time_decode_graph", "time_all_reduce"})
"""The methods rank 0 calls on every rank (through `send`): each runs collectives."""


class ModelRunner:
    """`tp`: this rank's tensor-parallel group (`loaded` is its shard). `send(method, *args)`:
    on rank 0 of several, hands a call of `WORKER_CALLS` to the other ranks (they run it on
    their runner); `alive()` raises when one of them has died (checked before each step and
    while waiting for one)."""

    def __init__(self, config: EngineConfig, loaded, backend: type[AttentionBackend], device: torch.device, *,
                 tp: TPGroup = SINGLE, send: Callable[..., None] | None = None,
                 alive: Callable[[], None] | None = None):
        self.model = loaded.model
        if device.type == "cpu":
            pack_linears_for_cpu(self.model)
        self.tp = tp
        self._send = send
        self._alive = alive
        self.spec = loaded.spec
        # this rank's KV heads (the pool holds those); the spec's are the whole model's
        self.num_kv_heads = local_heads(self.spec.num_kv_heads, tp.size, "num_key_value_heads", replicate=True)
        # Layers in KV cache groups (one unless windowed and full layers mix): the pool's cache
        # tensors are the groups' shared ones, then the cross layers'.
        self.kv_groups = KVCacheGroups.of(self.spec.sliding_windows)
        self.num_caches = self.kv_groups.num_tensors + self.spec.num_cross_layers
        self.audio = loaded.audio  # an audio encoder's LogMelInput, or None
        self.backend = backend
        self.device = device
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.batched_tokens(self.spec.max_model_len, device)
        lookahead = config.num_scheduler_steps - 1
        self.max_blocks_per_seq = cdiv(self.spec.max_model_len + 1 + lookahead, self.block_size)
        self.builder = GroupedMetadataBuilder(backend, self.block_size, device, self.kv_groups,
                                              self.spec.num_layers + self.spec.num_cross_layers)
        self.builder.set_layers(self.model)  # backends that plan per layer plan these
        self.cascade = _cascade_policy(config, self.model, device)
        self.cache_dtype = kv_cache_dtype(config.kv_cache_dtype, self.spec.dtype)
        self.default_generator = torch.Generator(device=device).manual_seed(config.seed)
        self.sampler = Sampler(self.default_generator)
        self.eos_token_ids = frozenset(self.spec.eos_token_ids)  # masked under min_tokens
        self.use_graphs = device.type == "cuda" and not config.enforce_eager and not self.spec.num_cross_layers
        # a third family of decode graphs, whose shared prefix is attended apart (engine/cascade.py)
        self.cascade_graphs = self.use_graphs and self.cascade.active and backend.get_state_cls().shared_prefix_graphs
        self.pool_sizer = KVPoolSizer(self)

        self.num_blocks = self.pool_sizer.num_kv_blocks(config)
        shape = backend.get_kv_cache_shape(self.num_blocks, self.block_size, self.num_kv_heads, self.spec.head_size)
        self.cache_tensors = [torch.zeros(shape, dtype=self.cache_dtype, device=device) for _ in range(self.num_caches)]
        # Each layer's cache in `layer_idx` order: decoder layers' (a tensor per group position), then cross layers'.
        groups_end = self.kv_groups.num_tensors
        self.kv_caches = self.kv_groups.layer_caches(self.cache_tensors[:groups_end]) + self.cache_tensors[groups_end:]
        self.num_cross_blocks = self.num_blocks if self.spec.num_cross_layers else 0
        self.num_cpu_blocks = self.pool_sizer.num_cpu_blocks(config, self.num_blocks)
        cpu_shape = backend.get_kv_cache_shape(self.num_cpu_blocks, self.block_size, self.num_kv_heads,
                                               self.spec.head_size)
        pin = device.type == "cuda"
        # Untouched CPU pages cost nothing until a swap writes them.
        self.cpu_caches = (
            [torch.empty(cpu_shape, dtype=self.cache_dtype, pin_memory=pin) for _ in range(self.num_caches)]
            if self.num_cpu_blocks
            else []
        )
        self.num_cpu_cross_blocks = self.num_cpu_blocks if self.spec.num_cross_layers else 0
        logger.info(
            "KV cache: %d blocks of %d tokens on %s (%s, %d KV heads), %d CPU swap blocks%s",
            self.num_blocks, self.block_size, device, self.cache_dtype, self.num_kv_heads, self.num_cpu_blocks,
            " (decoder and cross pools each)" if self.spec.num_cross_layers else "",
        )
        if device.type == "cuda" and not self.spec.num_cross_layers:
            self._warm_up()
        self.graphs = None
        if self.use_graphs:
            self.graphs = self._capture_graphs()

    def _capture_graphs(self) -> DecodeGraphs:
        """The decode graphs, or a ValueError with the numbers when the device cannot hold them
        beside the KV pool (the engine is refused at start-up rather than failing mid-capture)."""
        before = torch.cuda.memory_allocated(self.device)
        try:
            graphs = DecodeGraphs(
                self.model, self.backend, self.builder, self.kv_caches, max_num_seqs=self.max_num_seqs,
                max_blocks_per_seq=self.max_blocks_per_seq, block_size=self.block_size, device=self.device,
                cascade_min_seqs=self.cascade.min_seqs if self.cascade_graphs else None,
            )
        except torch.OutOfMemoryError as exc:
            free, total = torch.cuda.mem_get_info(self.device)
            raise ValueError(
                f"expected room for the decode CUDA graphs of up to max_num_seqs={self.max_num_seqs} sequences "
                f"(about {self.pool_sizer.graph_reserve / GIB:.2f} GiB reserved for them) beside a KV pool of "
                f"{self.num_blocks} blocks ({self.num_blocks * self.pool_sizer.block_bytes() / GIB:.2f} GiB), got an "
                f"out-of-memory error with {free / GIB:.2f} of {total / GIB:.2f} GiB free; lower max_num_seqs "
                f"(--max-num-seqs) or gpu_memory_utilization, or run without graphs (enforce_eager, --enforce-eager)"
            ) from exc
        took = torch.cuda.memory_allocated(self.device) - before
        logger.info("decode graphs hold %.2f GiB (%.2f GiB kept for them)", took / GIB,
                    self.pool_sizer.graph_reserve / GIB)
        return graphs

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Run `warmup_steps` (dummy steps of every shape class) so kernels compile now, not mid-run;
        each step the cascade policy would cascade (its sequences share their tables) runs again
        so (the shared part's launch and the LSE-writing ones are variants of their own)."""
        steps = warmup_steps(block_size=self.block_size, num_blocks=self.num_blocks,
                             max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
                             max_model_len=self.spec.max_model_len, plan_lengths=self.backend.plan_context_lens())
        start = time.perf_counter()
        cascaded = 0
        with kv_scale_calibration_paused(self.model):  # dummy K/V must not set FP8 scales
            for seqs in steps:
                positions = [p for s in seqs for p in range(s.context_len, s.seq_len)]
                pos = self._device_ints(positions)
                self._run(self.builder.build(seqs), torch.zeros_like(pos), pos)
                tables = [(s.block_table,) * (len(self.kv_groups.groups) - 1) for s in seqs]
                blocks = self.cascade.prefix_blocks(seqs, tables, self.kv_groups.windows, self.block_size)
                if blocks:
                    self._run(self.builder.build(seqs, shared_prefix_blocks=blocks), torch.zeros_like(pos), pos)
                    cascaded += 1
        torch.cuda.synchronize(self.device)
        logger.info("warmed up on %d dummy steps (%d of them cascaded too) in %.1f s", len(steps), cascaded,
                    time.perf_counter() - start)

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, after: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's block moves, model and sampler; read what it drew with `results()`
        (one `StepResult` per model step: `out.num_steps`, none when no chunk was scheduled).

        `after`: the launched step that `out` continues (`Scheduler.schedule_next_decodes`):
        each chunk's input token is that step's draw for its sequence, read on the device,
        not yet known on the host."""
        if self._alive is not None:
            self._alive()
        plan = StepPlan.of(out, carried_rows=after.row_of if after is not None else None,
                           vocab_size=self.spec.vocab_size)
        plan.cascade_blocks = self.cascade.prefix_blocks(plan.seqs, plan.group_tables, self.kv_groups.windows,
                                                         self.block_size)
        every_row_sampled = all(c.sample for c in out.chunks)
        replayable = out.chunks and (out.num_steps > 1 or (out.is_decode_only and every_row_sampled
                                                           and plan.prompt is None))
        plan.pad_to = self._graph_size(len(plan.seqs)) if replayable else None
        if plan.cascade_blocks and plan.pad_to is not None and plan.pad_to not in self.graphs.cascade_sizes:
            plan.cascade_blocks = 0  # a replayed graph attending whole beats an eager cascade step (docs/PERF.md)
        if self._send is not None and not plan.is_empty:
            self._send("execute", plan)  # the other ranks run the same plan on their shards
        self._move_blocks(plan)
        if not out.chunks:
            return LaunchedStep(results=[])
        if out.num_steps > 1:
            return self._execute_multistep(plan, out.chunks)
        encoder = self._prepare_encoder(out.chunks)
        logits, ids = self._model_step(plan, after.tokens if after is not None else None, encoder)
        # async: each chunk's input token is its sequence's last, still on the device only
        return self._sample(out.chunks, logits, pending=ids if after is not None else None, prompt=plan.prompt)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> None:
        """A tensor-parallel worker's share of a step that rank 0 `launch`ed: the same block
        moves, model and output head; rank 0 samples (its draws reach this rank on the device
        when a later step or a multi-step run needs them)."""
        self._move_blocks(plan)
        if not plan.seqs:
            return
        if plan.num_steps > 1:
            self._multistep_model(plan, draw=None)
        else:
            self._model_step(plan)

    def _model_step(self, plan: StepPlan, carried: torch.Tensor | None = None, encoder: tuple | None = None):
        """The model and output head on one step: (logits float32 [sampled chunks, V] or None when
        none is sampled, input ids int64 [T]). Every rank runs it; `carried`: on rank 0, the
        draws that `plan.ids` index (async scheduling)."""
        ids, pos, sample_idx = self._inputs(plan, carried)
        md = self.builder.build(plan.group_seqs(), cuda_graph_pad_to=plan.pad_to,
                                shared_prefix_blocks=plan.cascade_blocks)
        if plan.pad_to is None:
            hidden = self._run(md, ids, pos, encoder)
            logits = None
            if plan.sample_idx:
                logits = self.model.compute_logits(hidden.index_select(0, sample_idx))  # [sampled chunks, V]
            if plan.prompt is not None:
                plan.prompt.top = self._prompt_logprobs(hidden, plan.prompt)
        else:
            logits = self.graphs.logits(md, ids, pos)[: len(plan.seqs)]
        return logits, ids

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor, pending: torch.Tensor | None = None,
                prompt: PromptPlan | None = None) -> LaunchedStep:
        """logits: float32 [S, V], row j for the j-th chunk that is sampled. pending: int64
        [len(chunks)], each chunk's last token where the host lacks it (one draw per chunk)."""
        # One pass over the chunks (every step, every sequence): each one's draws and where they lie.
        flat = []  # (params, generator) of each draw
        index = []  # logits row of each draw
        row_seqs = []  # the sequence of each draw
        beams = []  # (logits row, chunk) of each beam
        bounds = [0]  # chunk i's draws are flat[bounds[i]:bounds[i + 1]]
        row_of = {}  # id(sequence) -> its draw, for chunks that draw one token
        j = 0  # logits row of the next sampled chunk
        for i, c in enumerate(chunks):
            rows = c.sampling_rows()
            if rows:
                flat += rows
                index += [j] * len(rows)
                row_seqs += [c.seq] * len(rows)
                if len(rows) == 1:
                    row_of[id(c.seq)] = bounds[-1]
            if c.sample:
                if not rows and c.group.is_beam:  # asked only of a sampled chunk that draws nothing
                    beams.append((j, i))
                j += 1
            bounds.append(len(flat))
        draws, batch = [], None
        if flat:
            assert pending is None or len(flat) == len(chunks), "carried steps draw one token per chunk"
            batch = SamplingBatch.build(flat, self.spec.vocab_size, self.device, seqs=row_seqs, pending=pending,
                                        eos_token_ids=self.eos_token_ids)
            draw_logits = logits  # beams draw no row and forks several from one: keep `logits` for beams
            if index != list(range(logits.shape[0])):
                draw_logits = logits.index_select(0, self._device_ints(index))
            draws = [self.sampler.sample(draw_logits, batch)]
        beam_logprobs = {}
        if beams:
            full = torch.log_softmax(logits.index_select(0, self._device_ints([j for j, _ in beams])), dim=-1)
            beam_logprobs = {i: row for (_, i), row in zip(beams, full)}
        return LaunchedStep(draws=draws, batch=batch, bounds=bounds, beam_logprobs=beam_logprobs, row_of=row_of,
                            prompt=prompt, alive=self._alive)

    def _prompt_logprobs(self, hidden: torch.Tensor, plan: PromptPlan) -> TopLogprobs:
        """The plan's positions through the output head, `max_num_seqs` rows at a time (the rows
        the memory profile ran the head and the sampler on): hidden [T, H]."""
        flat = self._device_ints(plan.positions + plan.targets)
        n = len(plan.positions)
        positions, targets = flat[:n], flat[n:]
        k = max(k for _, _, k in plan.spans.values())
        parts = []
        for a in range(0, n, self.max_num_seqs):
            logits = self.model.compute_logits(hidden.index_select(0, positions[a : a + self.max_num_seqs]))
            parts.append(TopLogprobs.of(logits, targets[a : a + self.max_num_seqs], k))
        return TopLogprobs.cat(parts)

    def _device_ints(self, rows: list) -> torch.Tensor:
        """rows as an int64 tensor on the device, without waiting for the device: a pinned,
        non-blocking copy (a pageable one would wait for every queued step, async scheduling's)."""
        flat = torch.tensor(rows, dtype=torch.int64)
        if self.device.type == "cuda":
            return flat.pin_memory().to(self.device, non_blocking=True)
        return flat.to(self.device)

    def _execute_multistep(self, plan: StepPlan, chunks: list[ScheduledChunk]) -> LaunchedStep:
        """`plan.num_steps` decode steps of a decode-only batch, sampling on the device and
        advancing the metadata (and the batch's token counts) in place between them."""
        rows = [r for c in chunks for r in c.sampling_rows()]
        assert len(rows) == len(chunks), "multi-step batches are plain decodes: one sample per chunk"
        batch = SamplingBatch.build(rows, self.spec.vocab_size, self.device, seqs=[c.seq for c in chunks],
                                    eos_token_ids=self.eos_token_ids)
        draws = []

        def draw(logits: torch.Tensor) -> torch.Tensor:
            if draws:
                batch.advance(draws[-1].tokens)
            draws.append(self.sampler.sample(logits, batch))
            return draws[-1].tokens

        self._multistep_model(plan, draw)
        return LaunchedStep(draws=draws, batch=batch, bounds=list(range(len(chunks) + 1)), alive=self._alive)

    def _multistep_model(self, plan: StepPlan, draw: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """The model of a multi-step run, on every rank: `draw(logits)` (rank 0) samples each
        step's tokens int64 [n]; the other ranks get them by broadcast, to advance the metadata."""
        ids, pos, _ = self._inputs(plan)
        n = len(plan.seqs)
        pad_to = plan.pad_to
        if pad_to is not None and pad_to > n:  # advance_step reads every row of the batch
            ids = torch.cat([ids, ids.new_zeros(pad_to - n)])
            pos = torch.cat([pos, pos.new_zeros(pad_to - n)])
        md = self.builder.build(plan.group_seqs(), cuda_graph_pad_to=pad_to, shared_prefix_blocks=plan.cascade_blocks)
        tokens = None
        for step in range(plan.num_steps):
            if step:
                md.advance_step(ids, pos, tokens.unsqueeze(1), self.block_size, md.num_seqs, n)
            if pad_to is None:
                logits = self.model.compute_logits(self._run(md, ids, pos)[:n])
            else:
                logits = self.graphs.logits(md, ids, pos)[:n]
            tokens = draw(logits) if draw is not None else torch.empty(n, dtype=torch.int64, device=self.device)
            if step < plan.num_steps - 1:
                self.tp.broadcast(tokens)  # rank 0's draws to every rank: the next step's inputs

    def _move_blocks(self, plan: StepPlan) -> None:
        # Order matters: swapped-out blocks may be reused by swap-ins and copies of this step.
        n = self.kv_groups.num_tensors  # the decoder pool's caches come first, then the cross pool's
        gpu_pools = ((self.cache_tensors[:n], self.cpu_caches[:n]), (self.cache_tensors[n:], self.cpu_caches[n:]))
        for (gpus, cpus), pairs in zip(gpu_pools, (plan.swap_out, plan.cross_swap_out)):
            if pairs:
                mapping = torch.tensor(pairs, dtype=torch.int64)
                for gpu, cpu in zip(gpus, cpus):
                    self.backend.swap_blocks(gpu, cpu, mapping)
        for (gpus, cpus), pairs in zip(gpu_pools, (plan.swap_in, plan.cross_swap_in)):
            if pairs:
                mapping = torch.tensor(pairs, dtype=torch.int64)
                for gpu, cpu in zip(gpus, cpus):
                    self.backend.swap_blocks(cpu, gpu, mapping)
        if plan.copies:  # cross blocks are never written after their prefill: no copy-on-write
            self.backend.copy_blocks(self.cache_tensors[:n], self._device_ints(plan.copies))

    def _inputs(self, plan: StepPlan, carried: torch.Tensor | None = None):
        """Input ids and positions int64 [T], sampled-row indices int64 [S] (one H2D copy). With
        `plan.carried` the ids are rows of the previous step's draws: rank 0 gathers them from
        `carried` and broadcasts them to the other ranks (a device collective, no host wait)."""
        flat = self._device_ints(plan.ids + plan.positions + plan.sample_idx)
        k, t = len(plan.ids), len(plan.positions)
        ids = flat[:k]
        if plan.carried:
            if self.tp.rank == 0:
                ids = carried.index_select(0, ids)
            else:
                ids = torch.empty(t, dtype=torch.int64, device=self.device)
            self.tp.broadcast(ids)
        return ids, flat[k : k + t], flat[k + t :]

    def _prepare_encoder(self, chunks: list[ScheduledChunk]) -> tuple | None:
        """The encoder prompts of the step's prefills, in chunk order (as `build` lays out the
        encoder tokens): (input, positions int64 [num_encoder_tokens]), the input being token
        ids int64 [num_encoder_tokens], or for an audio encoder each prefill's float32 features
        [num_mel_bins, frames]; None when the step runs no encoder."""
        ids: list[int] = []
        features: list[torch.Tensor] = []
        positions: list[int] = []
        for c in chunks:
            if c.num_encoder_tokens:
                positions += range(c.num_encoder_tokens)
                if c.seq.encoder_features is not None:
                    features.append(c.seq.encoder_features.values.to(self.device))
                else:
                    ids += c.seq.encoder_token_ids
        if not positions:
            return None
        flat = self._device_ints(ids + positions)
        if self.audio is not None:
            return features, flat
        return flat[: len(ids)], flat[len(ids) :]

    def forward_model(self, ids: torch.Tensor, pos: torch.Tensor, encoder: tuple | None):
        """The model on one step's inputs (inside a forward context): hidden [T, H]."""
        if self.spec.num_cross_layers:
            return self.model(ids, pos, *(encoder or (None, None)))
        return self.model(ids, pos)

    def _run(self, md: StepMetadata, ids: torch.Tensor, pos: torch.Tensor, encoder: tuple | None = None):
        """hidden [T, H], eagerly; `encoder`: the step's encoder input and positions (`_prepare_encoder`)."""
        with md.context(self.kv_caches):
            return self.forward_model(ids, pos, encoder)

    # ------------------------------------------------------------------ CUDA graphs

    def _graph_size(self, batch_size: int) -> int | None:
        """The captured batch size that serves `batch_size` decodes, or None (eager)."""
        return self.graphs.size_for(batch_size) if self.graphs is not None else None

    def time_decode_graph(self, batch_size: int, reps: int = 20) -> float | None:
        """Device seconds of one decode graph replay (`DecodeGraphs.time_replay`); None without
        graphs. With tensor parallelism every rank replays (the graphs' collectives pair up)."""
        if self.graphs is None:
            return None
        if self._send is not None:
            self._send("time_decode_graph", batch_size, reps)
        return self.graphs.time_replay(batch_size, reps)

    @torch.inference_mode()
    def time_all_reduce(self, num_tokens: int, reps: int = 20) -> float | None:
        """Seconds of one all-reduce of [num_tokens, hidden] activations in the model dtype over
        the tensor-parallel group, as a row-parallel layer runs it (`time_all_reduce`: in a CUDA
        graph of 2 x layers of them, as a decode step runs them); None without tensor parallelism."""
        if self.tp.size == 1:
            return None
        if self._send is not None:
            self._send("time_all_reduce", num_tokens, reps)
        x = torch.zeros(num_tokens, self.spec.hidden_size, dtype=self.spec.dtype, device=self.device)
        return time_all_reduce(self.tp, x, count=2 * self.spec.num_layers, reps=reps)


def _cascade_policy(config: EngineConfig, model, device: torch.device) -> CascadePolicy:
    """The engine's cascade policy; off, with the reason logged, when no layer of `model` can
    attend a shared prefix apart (`Attention.cascade_refusal`)."""
    refusal = None
    enabled = config.resolved_cascade_attention(device)
    if enabled:
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        if not any(m.prefix_impl is not None for m in layers):
            refusal = "; ".join(sorted({m.cascade_refusal for m in layers})) or "the model has no attention layer"
            logger.info("cascade attention off: no layer can attend a shared prefix apart (%s)", refusal)
    return CascadePolicy(enabled, config.cascade_min_prefix_tokens, config.cascade_min_seqs, refusal)
