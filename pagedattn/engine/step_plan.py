"""`StepPlan`: a scheduled step as every rank's model runner needs it, in host ints only.

Rank 0 makes it from the scheduler's output (`StepPlan.of`); with tensor parallelism it is sent
to the other ranks once per step, pickled (`TPGroup.send`), and each rank runs the same plan
on its shard: the same block moves in its own KV pool, the same metadata, the same model
launches in the same order (their collectives pair up), the same output-head passes. Only
rank 0 samples. What a plan cannot carry, rank 0 sends on the device: the input tokens of a
step launched before the previous step's draws reached the host (`carried`).
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass, field, replace

from pagedattn.attention.types import ScheduledSeq
from pagedattn.engine.logprobs import PromptPlan, num_logprobs
from pagedattn.engine.scheduler import ScheduledChunk, SchedulerOutput


@dataclass
class StepPlan:
    """One step's host inputs (the `SchedulerOutput`'s fields without its sequences).

    ids: the step's input token ids [T]; with `carried`, instead the rows of the previous
        step's draws (`LaunchedStep.tokens`) that hold them, one per chunk.
    positions: [T]; sample_idx: the query tokens whose hidden states go through the output
        head to be sampled (each sampled chunk's last).
    pad_to: the decode graph's batch size that runs the step (None: eager).
    num_steps: decode steps run back to back (multi-step), each sampled on rank 0.
    prompt: the positions whose prompt log-probabilities are computed, or None.
    seqs are over KV cache group 0's block tables; `group_tables[i]` are sequence i's tables of
    groups 1.. (models of windowed and full layers; empty with one group).
    cascade_blocks: the shared prefix the step attends once for all its queries (`engine/cascade.py`:
        the first blocks of every sequence's tables in each full-attention group), 0 for none.
    """

    seqs: list[ScheduledSeq] = field(default_factory=list)
    group_tables: list[tuple[tuple[int, ...], ...]] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    sample_idx: list[int] = field(default_factory=list)
    carried: bool = False
    pad_to: int | None = None
    num_steps: int = 1
    prompt: PromptPlan | None = None
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    cross_swap_out: list[tuple[int, int]] = field(default_factory=list)
    cross_swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    cascade_blocks: int = 0

    def __getstate__(self) -> dict:
        # Sequences as tuples: pickling frozen dataclasses costs 4x as much (64 of them: 180 us).
        # Their block tables as one int32 buffer: a pickled int is an opcode each way, an object
        # made per id on unpickling (256 sequences of 60 blocks, measured on the CPU, 2026-11-27).
        # (struct.pack of one list: array.extend from tuples converts id by id, 4x slower.)
        state = dict(self.__dict__)
        tables: list[int] = []
        for s in self.seqs:
            tables += s.block_table
        state["seqs"] = [(s.seq_len, s.query_len, len(s.block_table), s.encoder_len, s.cross_block_table)
                         for s in self.seqs]
        state["tables"] = struct.pack(f"{len(tables)}i", *tables)
        return state

    def __setstate__(self, state: dict) -> None:
        tables = array("i")
        tables.frombytes(state.pop("tables"))
        seqs, start = [], 0
        for seq_len, query_len, n, encoder_len, cross in state["seqs"]:
            seqs.append(ScheduledSeq(seq_len, query_len, tables[start:start + n], encoder_len, cross))
            start += n
        state["seqs"] = seqs
        self.__dict__.update(state)

    def group_seqs(self) -> list[list[ScheduledSeq]]:
        """The step's sequences over each KV cache group's block tables (`GroupedMetadataBuilder.build`)."""
        groups = [self.seqs]
        for g in range(max((len(t) for t in self.group_tables), default=0)):
            groups.append([replace(s, block_table=t[g]) for s, t in zip(self.seqs, self.group_tables)])
        return groups

    @property
    def is_empty(self) -> bool:
        """Nothing for a runner to do: no block moves, no chunk."""
        return not (self.seqs or self.swap_out or self.swap_in or self.cross_swap_out or self.cross_swap_in
                    or self.copies)

    @classmethod
    def of(cls, out: SchedulerOutput, *, carried_rows: dict[int, int] | None, vocab_size: int) -> StepPlan:
        """The plan of `out`. carried_rows: id(sequence) -> its row in the draws of the step that
        `out` continues (async scheduling), or None when the host holds every input token."""
        plan = cls(seqs=[c.scheduled for c in out.chunks], group_tables=[c.block_tables[1:] for c in out.chunks],
                   carried=carried_rows is not None, num_steps=out.num_steps,
                   swap_out=out.swap_out, swap_in=out.swap_in, cross_swap_out=out.cross_swap_out,
                   cross_swap_in=out.cross_swap_in, copies=out.copies)
        for c in out.chunks:
            start, end = c.scheduled.context_len, c.scheduled.seq_len
            if carried_rows is None:
                plan.ids += c.seq.token_ids[start:end]
            else:
                plan.ids.append(carried_rows[id(c.seq)])  # the row of its token in the previous step's draws
            plan.positions += range(start, end)
            if c.sample:
                plan.sample_idx.append(len(plan.positions) - 1)
        plan.prompt = _prompt_plan(out.chunks, vocab_size)
        return plan


def _prompt_plan(chunks: list[ScheduledChunk], vocab_size: int) -> PromptPlan | None:
    """The step's positions that predict a prompt token whose log-probabilities are asked for
    and not yet recorded (a recomputed prompt's were), or None. Position p predicts token
    p + 1: those of tokens 1..P-1 of a P-token prompt."""
    positions: list[int] = []
    targets: list[int] = []
    spans: dict[int, tuple[int, int, int]] = {}
    offset = 0  # the chunk's first query token in the step
    for i, c in enumerate(chunks):
        start, end = c.scheduled.context_len, c.scheduled.seq_len
        recorded = c.group.prompt_logprobs
        if recorded is not None:
            first, last = max(start, len(recorded) - 1), min(end, c.seq.num_prompt_tokens - 1)
            if first < last:
                # such requests read no prefix cache, so their chunks leave no position out
                assert start <= len(recorded) - 1, (start, len(recorded), c.seq)
                spans[i] = (len(targets), len(targets) + last - first,
                            num_logprobs(c.group.params.prompt_logprobs, vocab_size))
                positions += range(offset + first - start, offset + last - start)
                targets += c.seq.token_ids[first + 1 : last + 1]
        offset += end - start
    return PromptPlan(positions, targets, spans) if spans else None
