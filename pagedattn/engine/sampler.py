"""Token sampling on the device: guided decoding's masks, logit bias, the min_tokens mask,
penalties, greedy, temperature, min_p, top-k, top-p, per-request generators; and the
log-probabilities a request asks for.

The order is vLLM V1's: guided rows' grammar masks (in place, before anything: they are the
logits the model may choose from), bias and the min_tokens mask, then penalties (these change
greedy choices too), then the argmax for greedy rows; sampled rows divide by their temperature,
drop tokens under min_p, then outside top-k / top-p, and draw. Returned log-probabilities are
the model's (after the grammar mask, before the rest), as `cumulative_logprob`.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from pagedattn.engine.grammar import GrammarMask
from pagedattn.engine.logprobs import TopLogprobs, num_logprobs
from pagedattn.engine.penalties import Penalties
from pagedattn.engine.sampling_params import GREEDY_EPS, SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling options of a step, as device tensors built once, only for the rows and
    options in use: an all-greedy batch without options has none (argmax needs none, and a
    step spares their copies); any other makes one host-to-device copy.

    temperatures: float32 [R] (0 for greedy rows); top_k: int64 [R] (vocab size when off);
    top_p: float32 [R]; min_p: float32 [R] (0 for greedy rows), None when no row uses it.
    generators: one per row, None to use the engine's default generator.
    bias: (rows int64 [N], token ids int64 [N], biases float32 [N]), every row's logit_bias.
    masked: (rows int64 [M], token ids int64 [M], countdown int64 [M]): the stop tokens (EOS
        unless ignore_eos, stop_token_ids) of rows under min_tokens, masked while countdown > step.
    penalties: the penalised rows' `Penalties`.
    grammar: the guided rows' `GrammarMask` (filled from their completions' grammar matchers).
    logprob_rows, logprob_ks: the rows that return logprobs (host ints) and each one's top-k
        size; logprob_index: those rows on the device, None when they are every row.
    step: draws made with this batch so far (`advance`; multi-step decoding makes several).
    """

    temperatures: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    generators: list[torch.Generator | None]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    min_p: torch.Tensor | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    masked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None
    grammar: GrammarMask | None = None
    logprob_rows: tuple[int, ...] = ()
    logprob_ks: tuple[int, ...] = ()
    logprob_index: torch.Tensor | None = None
    step: int = 0

    @classmethod
    def build(
        cls,
        rows: list[tuple[SamplingParams, torch.Generator | None]],
        vocab_size: int,
        device: torch.device,
        *,
        seqs: Seq | None = None,
        pending: torch.Tensor | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> SamplingBatch:
        """rows: (params, generator) per row. seqs[i]: the `Sequence` whose next token row i
        draws (its tokens feed penalties, its output count min_tokens, its grammar matcher the
        guided mask); needed when a row has any. pending: int64 [R] on the device, each row's
        last token when the host does not hold it yet (async scheduling: `seqs[i].token_ids`
        lacks it), else None; never with guided rows (a mask needs the token before it)."""
        # One pass, plain attribute reads: this runs every step for every row. Greedy rows keep
        # the neutral options, so only the sampled rows are visited again.
        sampled, extra = [], []
        for i, (p, _) in enumerate(rows):
            if p.temperature >= GREEDY_EPS:
                sampled.append(i)
            if (p.logit_bias or p.min_tokens or p.logprobs is not None or p.presence_penalty
                    or p.frequency_penalty or p.repetition_penalty != 1.0 or p.guided_decoding is not None):
                extra.append(i)
        n = len(rows)
        temps, top_k, top_p, min_p = [0.0] * n, [vocab_size] * n, [1.0] * n, [0.0] * n
        for i in sampled:
            p = rows[i][0]
            temps[i] = float(p.temperature)
            top_k[i] = vocab_size if p.top_k < 1 else min(p.top_k, vocab_size)
            top_p[i] = float(p.top_p)
            min_p[i] = float(p.min_p)
        all_greedy = not sampled
        batch = cls(temperatures=None, top_k=None, top_p=None, generators=[g for _, g in rows],
                    all_greedy=all_greedy, any_top_k=any(top_k[i] < vocab_size for i in sampled),
                    any_top_p=any(top_p[i] < 1.0 for i in sampled))
        if all_greedy and not extra:
            return batch
        stage = _Staging()
        if not all_greedy:
            s_options = stage.add(temps + top_k + top_p)
            s_min_p = stage.add(min_p) if any(min_p) else None
        bias, masked, penalised, lp_rows, guided = [], [], [], [], []
        for i in extra:
            p = rows[i][0]
            if p.logit_bias:
                bias += [(i, t, b) for t, b in p.logit_bias.items()]
            if p.min_tokens:
                countdown = p.min_tokens - seqs[i].num_output_tokens - (pending is not None)
                if countdown > 0:
                    stops = dict.fromkeys(p.stop_token_ids) | dict.fromkeys(() if p.ignore_eos else eos_token_ids)
                    masked += [(i, t, countdown) for t in stops]
            if p.has_penalties:
                penalised.append(i)
            if p.logprobs is not None:
                lp_rows.append(i)
            if p.guided_decoding is not None:
                guided.append((i, seqs[i].grammar))
        if guided:
            assert pending is None, "steps with guided rows are not carried: their masks need the last token"
            batch.grammar = GrammarMask.build(guided, vocab_size, device)
        if bias:
            s_bias = stage.add([x for column in zip(*bias) for x in column])
        if masked:
            s_masked = stage.add([x for column in zip(*masked) for x in column])
        if penalised:
            pen = _stage_penalties(stage, [rows[i][0] for i in penalised], [seqs[i] for i in penalised],
                                   penalised if len(penalised) < len(rows) else None)
        s_lp = stage.add(lp_rows) if 0 < len(lp_rows) < len(rows) else None
        values = stage.copy(device)  # float64: token ids and counts are exact in it
        if not all_greedy:
            options = values[s_options].view(3, -1)
            batch.temperatures, batch.top_k, batch.top_p = options[0].float(), options[1].long(), options[2].float()
            batch.min_p = values[s_min_p].float() if s_min_p is not None else None
        if bias:
            bias_rows, bias_ids, biases = values[s_bias].view(3, -1)
            batch.bias = (bias_rows.long(), bias_ids.long(), biases.float())
        if masked:
            batch.masked = tuple(values[s_masked].long().view(3, -1))
        if penalised:
            batch.penalties = pen.build(values, vocab_size)
            if pending is not None:
                batch.penalties.add(pending)
        batch.logprob_rows = tuple(lp_rows)
        batch.logprob_ks = tuple(num_logprobs(rows[i][0].logprobs, vocab_size) for i in lp_rows)
        batch.logprob_index = values[s_lp].long() if s_lp is not None else None
        return batch

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """logits float32 [R, V] with bias, the min_tokens mask and penalties applied: a new
        tensor, or `logits` itself when no row has any (the raw logits stay for log-probabilities)."""
        if self.bias is None and self.masked is None and self.penalties is None:
            return logits
        out = logits.clone()
        if self.bias is not None:
            rows, ids, values = self.bias
            out.index_put_((rows, ids), values, accumulate=True)
        if self.masked is not None:
            rows, ids, countdown = self.masked
            out.index_put_((rows, ids), torch.where(countdown > self.step, float("-inf"), 0.0), accumulate=True)
        if self.penalties is not None:
            self.penalties.apply(out)
        return out

    def advance(self, tokens: torch.Tensor) -> None:
        """After a draw of tokens int64 [R] (multi-step decoding): each row has one more
        generated token."""
        assert self.grammar is None, "guided rows draw one token per step (their masks need the last token)"
        self.step += 1
        if self.penalties is not None:
            self.penalties.add(tokens)


@dataclass
class Draws:
    """One draw of a batch: tokens int64 [R]; logprobs float32 [R], the model's log-probability
    of each; top: the log-probabilities of the rows that asked (`SamplingBatch.logprob_rows`)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    top: TopLogprobs | None = None


class Sampler:
    """`sample(logits [R, V] float32, batch) -> Draws`; guided rows of `logits` are masked in place.

    Sampling draws Exp(1) noise per row from the row's own generator and takes
    argmax(probs / noise), which is a draw from `probs`; so a seeded request gets the same
    tokens whatever else is in the batch. Log-probabilities are the model's (before bias,
    penalties, temperature, min_p, top-k and top-p; after a guided row's grammar mask), for
    `cumulative_logprob` and `logprobs`.
    """

    def __init__(self, default_generator: torch.Generator):
        self.default_generator = default_generator

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> Draws:
        if batch.grammar is not None:
            batch.grammar.apply(logits)
        processed = batch.process(logits)
        tokens = processed.argmax(dim=-1)  # [R]
        if not batch.all_greedy:
            random = batch.temperatures > 0  # [R]
            scaled = processed / torch.where(random, batch.temperatures, 1.0).unsqueeze(1)
            if batch.min_p is not None:
                scaled = _apply_min_p(scaled, batch.min_p)
            if batch.any_top_k or batch.any_top_p:
                scaled = _apply_top_k_top_p(scaled, batch.top_k, batch.top_p, batch.any_top_k, batch.any_top_p)
            probs = torch.softmax(scaled, dim=-1)
            noise = torch.empty_like(probs)
            if all(g is None for g in batch.generators):
                noise.exponential_(generator=self.default_generator)
            else:
                for i, g in enumerate(batch.generators):
                    noise[i].exponential_(generator=g or self.default_generator)
            sampled = (probs / noise.clamp_min_(1e-10)).argmax(dim=-1)
            tokens = torch.where(random, sampled, tokens)
        # the chosen tokens' log-probabilities, without a [R, V] log_softmax written and read back
        chosen = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)
        top = None
        if batch.logprob_rows:
            index = batch.logprob_index
            rows = (logits, tokens) if index is None else (logits.index_select(0, index), tokens.index_select(0, index))
            top = TopLogprobs.of(*rows, max(batch.logprob_ks))
        return Draws(tokens, chosen - torch.logsumexp(logits, dim=-1), top)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens whose probability is under min_p times the row's largest.
    logits: float32 [R, V] (after temperature); min_p: float32 [R] (0 keeps every token)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [R, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, any_top_k: bool, any_top_p: bool
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus. logits: float32 [R, V]."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
    if any_top_k:
        ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)  # [1, V]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if any_top_p:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # [R, V]; the top token always stays
        sorted_logits = sorted_logits.masked_fill(mass_before > top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class _Staging:
    """Host values gathered for one float64 copy to the device (ints are exact in it up to 2**53),
    from pinned memory on CUDA, so the host does not wait for the steps queued before (a pageable
    copy may). `add` returns where the values will lie in the copy."""

    def __init__(self):
        self._values: list[float] = []

    def add(self, values: list) -> slice:
        self._values += values
        return slice(len(self._values) - len(values), len(self._values))

    def copy(self, device: torch.device) -> torch.Tensor:
        host = torch.tensor(self._values, dtype=torch.float64)
        return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


@dataclass
class _StagedPenalties:
    rows: slice | None
    generated: slice
    prompt: slice | None
    factors: slice

    def build(self, values: torch.Tensor, vocab_size: int) -> Penalties:
        return Penalties.build(
            values[self.rows].long() if self.rows is not None else None,
            tuple(values[self.generated].long().view(2, -1)),
            tuple(values[self.prompt].long().view(2, -1)) if self.prompt is not None else None,
            values[self.factors].float().view(3, -1),
            vocab_size,
        )


def _stage_penalties(stage: _Staging, params: list[SamplingParams], seqs: list, rows: list[int] | None):
    """Stage the penalised rows' (row, token) pairs: generated tokens of each (its counts), and
    prompt tokens when some row has a repetition penalty."""
    gen_rows, gen_ids, prompt_rows, prompt_ids = [], [], [], []
    any_repetition = any(p.repetition_penalty != 1.0 for p in params)
    for j, (p, seq) in enumerate(zip(params, seqs)):
        n = seq.num_prompt_tokens
        generated = seq.token_ids[n:]
        gen_rows += [j] * len(generated)
        gen_ids += generated
        if p.repetition_penalty != 1.0:
            prompt_rows += [j] * n
            prompt_ids += seq.token_ids[:n]
    factors = [float(p.presence_penalty) for p in params] + [float(p.frequency_penalty) for p in params]
    factors += [float(p.repetition_penalty) for p in params]
    return _StagedPenalties(
        rows=stage.add(rows) if rows is not None else None,
        generated=stage.add(gen_rows + gen_ids),
        prompt=stage.add(prompt_rows + prompt_ids) if any_repetition else None,
        factors=stage.add(factors),
    )
