"""Continuous batching: which sequences compute which tokens in the next step.

One step runs at most `max_num_batched_tokens` tokens of at most `max_num_seqs` sequences.
Requests are served first come, first served:
1. Running groups, oldest first. Each sequence computes its uncomputed tokens (1 for a
   decode); a long prefill is chunked to the budget left after the decodes of the groups
   behind it. When blocks run out, the newest running group not yet scheduled is preempted
   (recomputed later, or swapped to the CPU pool), down to the group itself.
2. If nothing was preempted: swapped groups come back, oldest first.
3. If nothing is swapped out: waiting groups are admitted, oldest first, taking their cached
   prefix; the first that does not fit stops admission (head-of-line, so order is kept).
Beam-search groups move in lockstep: their beams' last tokens are computed in one step (a
beam is scored against the others), earlier tokens may be chunked.

Encoder-decoder requests: a sequence's prefill step runs its encoder prompt through the
encoder (the step's encoder tokens are those of its prefills) and writes the cross K/V into
its cross blocks, taken when the step is committed. Every later step is a decode that reads
them. So such a prefill is never chunked (a second chunk would be a prefill too and run the
encoder again, as vLLM V0 also refused): it computes all its uncomputed tokens in one step,
and its encoder tokens count against the step's token budget. A recompute preemption frees
the cross blocks; the recomputing prefill runs the encoder again.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from pagedattn.attention.types import ScheduledSeq, is_prefill
from pagedattn.engine.block_manager import BlockManager
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.engine.sequence import Sequence, SequenceGroup, SeqStatus
from pagedattn.intmath import cdiv


@dataclass
class ScheduledChunk:
    """Tokens `[context_len, seq_len)` of `seq` in this step.

    `scheduled` is what the metadata builder gets (lengths and `seq.block_table` as of this
    step); its `is_prefill` is the one prefill-or-decode rule the engine reads. `block_tables`
    are the sequence's tables of every KV cache group as of this step (the first is
    `scheduled.block_table`); `scheduled_in(g)` is what group `g`'s builder gets.
    """

    seq: Sequence
    group: SequenceGroup
    scheduled: ScheduledSeq
    sample: bool  # the chunk ends at the sequence's last token: its logits are sampled
    block_tables: tuple[tuple[int, ...], ...] = ()

    def scheduled_in(self, kv_group: int) -> ScheduledSeq:
        """The chunk over KV cache group `kv_group`'s block table."""
        return self.scheduled if kv_group == 0 else replace(self.scheduled, block_table=self.block_tables[kv_group])

    @property
    def num_tokens(self) -> int:
        """The step's query_len for this sequence."""
        return self.scheduled.query_len

    @property
    def num_encoder_tokens(self) -> int:
        """Encoder tokens this chunk runs: its encoder prompt when it is a prefill, else 0."""
        s = self.scheduled
        return _encoder_tokens(s.encoder_len, s.seq_len, s.query_len)

    def sampling_rows(self) -> list[tuple[SamplingParams, torch.Generator | None]]:
        """What the sampler draws for this chunk, one (params, generator) per token: none when
        the chunk is not sampled or belongs to a beam search (scored on full log-probabilities),
        `width` when a prompt's sample forks into `best_of`/`n` sequences, else one."""
        group = self.group
        if not self.sample or group.is_beam:
            return []
        if group.needs_fork:
            return [(group.params, g) for g in group.generators]
        return [(group.params, self.seq.generator)]


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # prefills first, then decodes
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (GPU block, CPU block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (CPU block, GPU block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) GPU blocks
    cross_swap_out: list[tuple[int, int]] = field(default_factory=list)  # cross pool (GPU block, CPU block)
    cross_swap_in: list[tuple[int, int]] = field(default_factory=list)  # cross pool (CPU block, GPU block)
    num_steps: int = 1  # decode steps to run back to back (multi-step); 1 unless decode-only
    preempted: list[SequenceGroup] = field(default_factory=list)
    # Groups the scheduler finished itself: bad or oversized requests ("error"), and a lone
    # request that outgrew the pool after generating ("length": it keeps its tokens).
    ended: list[SequenceGroup] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens the step computes: query tokens and encoder tokens."""
        return sum(c.num_tokens + c.num_encoder_tokens for c in self.chunks)

    @property
    def is_decode_only(self) -> bool:
        return not any(c.scheduled.is_prefill for c in self.chunks)


# (sequence, seq_len, query_len, sample its logits): a step of each sequence as host ints, its
# ScheduledSeq made once at commit with the tables (measured on the CPU, 2026-11-27: three
# ScheduledSeq per sequence per step were a third of `schedule` at 256 decodes)
Plan = list[tuple[Sequence, int, int, bool]]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        num_scheduler_steps: int = 1,
        preemption_mode: str = "auto",
    ):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"expected max_num_batched_tokens >= max_num_seqs ({max_num_seqs}), got {max_num_batched_tokens}"
            )
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked = enable_chunked_prefill
        self.num_scheduler_steps = num_scheduler_steps
        self.lookahead = num_scheduler_steps - 1
        self.preemption_mode = preemption_mode
        self.watermark = int(0.01 * block_manager.num_blocks)
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()

    # ------------------------------------------------------------------ queues

    def add(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            seq.status = SeqStatus.WAITING
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def all_seqs(self) -> list[Sequence]:
        """Every unfinished sequence (for `BlockManager.check_integrity`)."""
        groups = [*self.waiting, *self.running, *self.swapped]
        return [s for g in groups for s in g.live_seqs]

    def finish_seq(self, seq: Sequence, reason: str) -> None:
        self.bm.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def find(self, request_id: str) -> SequenceGroup | None:
        """The unfinished group of `request_id`, or None."""
        for group in (*self.waiting, *self.running, *self.swapped):
            if group.request_id == request_id:
                return group
        return None

    def abort(self, group: SequenceGroup, error: str) -> None:
        """Finish `group` with finish_reason "error", wherever it is."""
        group.error = error
        self._finish_group(group, "error")

    def cancel(self, group: SequenceGroup) -> None:
        """Finish `group` with finish_reason "abort" (its client went away), wherever it is;
        its blocks are free when this returns."""
        self._finish_group(group, "abort")

    def _finish_group(self, group: SequenceGroup, reason: str) -> None:
        for seq in group.live_seqs:
            self.finish_seq(seq, reason)
        self.remove_finished()
        for queue in (self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)

    def abort_unschedulable(self) -> SequenceGroup:
        """Fail the head request when nothing could run although requests wait: it can never
        be scheduled with this configuration (e.g. beams larger than the step budget)."""
        group = (self.running or list(self.swapped) or list(self.waiting))[0]
        self.abort(group, f"request {group.request_id} cannot be scheduled under the step budget")
        return group

    def remove_finished(self) -> None:
        self.running = [g for g in self.running if not g.is_finished]

    def _insert_by_arrival(self, queue: deque[SequenceGroup], group: SequenceGroup) -> None:
        i = 0
        while i < len(queue) and queue[i].arrival_index < group.arrival_index:
            i += 1
        queue.insert(i, group)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = _Budget(self.max_num_batched_tokens, self.max_num_seqs)
        self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_swapped(out, budget)
        if not out.preempted and not self.swapped:
            self._schedule_waiting(out, budget)
        self.running.sort(key=lambda g: g.arrival_index)
        out.chunks.sort(key=lambda c: not c.scheduled.is_prefill)  # stable: prefills first
        out.num_steps = self._num_steps(out)
        return out

    def schedule_next_decodes(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The step after `prev`, planned while `prev` still runs (async scheduling): each
        sequence `prev` samples decodes the token being sampled, whose value the runner carries
        on the device. That is the step `schedule` would make once `prev` is processed, unless
        what `prev` samples or the queues could change it: then None (and nothing is touched).
        None when requests wait or are swapped out, `prev` is multi-step, leaves a running
        sequence out, ends a chunk before its sequence's last token, forks (`n`, beams), runs
        a beam search or guided decoding (its grammar mask needs the token), or when the new
        slots would need more blocks than are free. A sequence that `prev`'s token ends by
        length (`max_tokens`, the model's context) is left out; an EOS or stop string found when
        `prev` is processed wastes that sequence's row of this step, whose result for it is then
        dropped (it is finished)."""
        if self.lookahead or self.waiting or self.swapped or prev.num_steps > 1:
            return None
        live = [c for c in prev.chunks if not c.seq.is_finished]
        running = {id(s) for g in self.running for s in g.seqs if not s.is_finished}
        if not live or len(live) != len(running):
            return None
        plan: Plan = []
        groups: list[SequenceGroup] = []
        for c in live:
            seq, group = c.seq, c.group
            params = group.params
            if (id(seq) not in running or not c.sample or params.use_beam_search or group.needs_fork
                    or params.guided_decoding is not None):
                return None
            known = c.scheduled.seq_len  # the tokens `prev` computes; it samples token `known`
            assert len(seq) == known, (len(seq), c.scheduled)
            if known - seq.num_prompt_tokens + 1 < params.max_tokens and known + 1 < self.max_model_len:
                plan.append((seq, known + 1, 1, True))
                groups.append(group)
        if not plan or self._blocks_needed(plan) > self.bm.num_free_blocks:
            return None
        out, budget = SchedulerOutput(), _Budget(self.max_num_batched_tokens, self.max_num_seqs)
        for group, step in zip(groups, plan):
            self._commit(group, [step], out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: _Budget) -> None:
        queue = deque(self.running)
        self.running = []
        # Decodes of groups behind a prefill keep their tokens: chunks get what is left.
        decode_tokens = {id(g): self._decode_tokens(g) for g in queue}
        reserved = sum(decode_tokens.values())
        while queue:
            group = queue.popleft()
            reserved -= decode_tokens[id(group)]
            plan = self._plan(group, budget.tokens - reserved, budget.seqs)
            if not plan:
                self.running.append(group)
                continue
            while self._blocks_needed(plan) > self.bm.num_free_blocks:
                if queue:
                    victim = queue.pop()
                    reserved -= decode_tokens[id(victim)]
                    self._preempt(victim, out)
                    continue
                if not self.running:  # alone and stuck: no preemption can make room
                    if all(s.output_token_ids for s in group.live_seqs):
                        self._finish_group(group, "length")  # the pool ends its context: keep its tokens
                    else:
                        self.abort(group, self._too_big_message(group))
                    out.ended.append(group)
                else:
                    self._preempt(group, out)
                group = None
                break
            if group is not None:
                self._commit(group, plan, out, budget)
                self.running.append(group)

    def _schedule_swapped(self, out: SchedulerOutput, budget: _Budget) -> None:
        while self.swapped:
            group = self.swapped[0]
            seqs = group.live_seqs
            plan = self._plan(group, budget.tokens, budget.seqs)
            if not plan:
                return
            # After swap-in every block is fresh; a shared last block (of each group) may still need a copy.
            need = self.bm.swap_in_cost(seqs) + self.bm.num_groups * sum(
                max(0, cdiv(self._target(n, q), self.block_size) - len(s.block_table)) + 1 for s, n, q, _ in plan
            )
            cross_need = self.bm.cross_swap_in_cost(seqs)
            if need > self.bm.num_free_blocks - self.watermark or cross_need > self.bm.num_free_cross_blocks:
                return
            self.swapped.popleft()
            moves, cross_moves = self.bm.swap_in(seqs)
            out.swap_in += moves
            out.cross_swap_in += cross_moves
            self._commit(group, plan, out, budget)
            self.running.append(group)

    def _schedule_waiting(self, out: SchedulerOutput, budget: _Budget) -> None:
        while self.waiting and budget.tokens > 0:
            group = self.waiting[0]
            seqs = group.live_seqs
            if self._min_blocks(group) > self.bm.num_blocks or self._cross_blocks(group) > self.bm.cross.num_blocks:
                self.abort(group, self._too_big_message(group))
                out.ended.append(group)
                continue
            running_seqs = sum(len(g.live_seqs) for g in self.running)
            if running_seqs + len(seqs) > self.max_num_seqs:
                return
            for seq in seqs:
                self.bm.allocate_prefix(seq)
            plan = self._plan(group, budget.tokens, budget.seqs)
            if (
                not plan
                or self._blocks_needed(plan) > self.bm.num_free_blocks - self.watermark
                or self._cross_blocks(group) > self.bm.num_free_cross_blocks
            ):
                for seq in seqs:  # roll back the taken prefix; cached blocks stay cached
                    self.bm.free(seq)
                    seq.reset_for_recompute()
                return
            self.waiting.popleft()
            for seq in seqs:
                seq.status = SeqStatus.RUNNING
            self._commit(group, plan, out, budget)
            self.running.append(group)

    # ------------------------------------------------------------------ helpers

    def _decode_tokens(self, group: SequenceGroup) -> int:
        """Tokens the group's next step computes if it is a decode of every sequence, else 0."""
        n = 0
        for s in group.live_seqs:
            r = s.num_uncomputed_tokens
            if is_prefill(s.num_computed_tokens + r, r):
                return 0
            n += 1
        return n

    def _plan(self, group: SequenceGroup, token_cap: int, seq_cap: int) -> Plan:
        seqs = group.live_seqs
        if group.is_beam and len(seqs) > 1:
            return self._plan_beams(seqs, token_cap, seq_cap)
        plan: Plan = []
        left = token_cap
        for s in seqs:  # each sequence's every remaining token, the one that does not fit chunked
            if left <= 0 or len(plan) == seq_cap:
                break
            computed, r = s.num_computed_tokens, s.num_uncomputed_tokens
            cost = r + _encoder_tokens(s.encoder_len, computed + r, r)
            if cost <= left:
                plan.append((s, computed + r, r, True))
                left -= cost
            elif self._chunkable(seqs):
                plan.append((s, computed + left, left, False))
                left = 0
        return plan

    def _plan_beams(self, seqs: list[Sequence], token_cap: int, seq_cap: int) -> Plan:
        """A beam search's step: every beam's remaining tokens, or all but their last tokens
        chunked (the last ones are computed in one step, as the beams are scored together)."""
        if len(seqs) > seq_cap:
            return []
        remaining = [s.num_uncomputed_tokens for s in seqs]
        costs = [r + _encoder_tokens(s.encoder_len, s.num_computed_tokens + r, r) for s, r in zip(seqs, remaining)]
        if sum(costs) <= token_cap:
            return [(s, s.num_computed_tokens + r, r, True) for s, r in zip(seqs, remaining)]
        plan: Plan = []
        left = token_cap if self._chunkable(seqs) else 0
        for s, r in zip(seqs, remaining):  # everything but the last tokens, chunked
            n = min(r - 1, left)
            if n > 0:
                plan.append((s, s.num_computed_tokens + n, n, False))
                left -= n
        return plan

    def _chunkable(self, seqs: list[Sequence]) -> bool:
        """An encoder-decoder prefill costs its encoder tokens too and is never chunked."""
        return self.chunked and not any(s.encoder_len for s in seqs)

    def _target(self, seq_len: int, query_len: int) -> int:
        """Tokens a sequence needs slots for after its step (lookahead slots for multi-step decodes)."""
        return seq_len + (0 if is_prefill(seq_len, query_len) else self.lookahead)

    def _blocks_needed(self, plan: Plan) -> int:
        bm = self.bm
        if not self.lookahead:
            return sum(bm.blocks_needed(s, n) for s, n, _, _ in plan)
        return sum(bm.blocks_needed(s, self._target(n, q)) for s, n, q, _ in plan)

    def _cross_blocks(self, group: SequenceGroup) -> int:
        """Cross blocks the group takes when admitted (each of its sequences has its own)."""
        return sum(self.bm.cross_blocks_needed(s) for s in group.live_seqs)

    def _min_blocks(self, group: SequenceGroup) -> int:
        """A lower bound of the blocks the group needs to make progress: its longest sequence
        and the slot of its next token (sequences may share blocks)."""
        return max(self.bm.min_blocks(len(s) + 1) for s in group.live_seqs)

    def _too_big_message(self, group: SequenceGroup) -> str:
        tokens = sum(len(s) for s in group.live_seqs)
        encoder = sum(s.encoder_len for s in group.live_seqs)
        return (
            f"request {group.request_id} ({len(group.live_seqs)} sequences, {tokens} tokens"
            f"{f', {encoder} encoder tokens' if encoder else ''}) needs more KV-cache blocks than "
            f"{'each pool (decoder, cross)' if encoder else 'the pool'} of {self.bm.num_blocks} blocks "
            f"of {self.block_size} tokens holds"
        )

    def _commit(self, group: SequenceGroup, plan: Plan, out: SchedulerOutput, budget: _Budget) -> None:
        if group.metrics.first_scheduled_time is None:
            group.metrics.first_scheduled_time = time.perf_counter()
        bm, lookahead = self.bm, self.lookahead
        for seq, seq_len, query_len, sample in plan:
            copies = bm.ensure_slots(seq, self._target(seq_len, query_len) if lookahead else seq_len)
            if copies:
                out.copies += copies
            encoder_len = seq.encoder_len
            if encoder_len:
                bm.ensure_cross_blocks(seq)
            # Copies: the block manager edits the tables in place after the step.
            tables = tuple(map(tuple, seq.block_tables))
            scheduled = ScheduledSeq(seq_len, query_len, tables[0], encoder_len, tuple(seq.cross_block_table))
            out.chunks.append(ScheduledChunk(seq, group, scheduled, sample, tables))
            budget.tokens -= query_len + _encoder_tokens(encoder_len, seq_len, query_len)
            budget.seqs -= 1

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        seqs = group.live_seqs
        group.metrics.num_preemptions += 1
        out.preempted.append(group)
        wants_swap = self.preemption_mode == "swap" or (self.preemption_mode == "auto" and len(seqs) > 1)
        if wants_swap and self.bm.can_swap_out(seqs):
            moves, cross_moves = self.bm.swap_out(seqs)
            out.swap_out += moves
            out.cross_swap_out += cross_moves
            self._insert_by_arrival(self.swapped, group)
            return
        for seq in seqs:
            self.bm.free(seq)
            seq.reset_for_recompute()
        self._insert_by_arrival(self.waiting, group)

    def _num_steps(self, out: SchedulerOutput) -> int:
        chunks = out.chunks
        if not self.lookahead or not chunks:
            return 1
        # a guided row's next mask needs the token drawn before it
        if not out.is_decode_only or any(c.group.is_beam or c.group.params.guided_decoding is not None for c in chunks):
            return 1
        room = min(self.max_model_len - len(c.seq) + 1 for c in chunks)
        wanted = max(c.group.params.max_tokens - c.seq.num_output_tokens for c in chunks)
        return max(1, min(self.num_scheduler_steps, room, wanted))


@dataclass
class _Budget:
    tokens: int
    seqs: int


def _encoder_tokens(encoder_len: int, seq_len: int, query_len: int) -> int:
    """Encoder tokens a step runs: a prefill's encoder prompt (0 for decoder-only models)."""
    return encoder_len if is_prefill(seq_len, query_len) else 0
