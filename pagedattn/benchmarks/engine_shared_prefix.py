"""The shared-prefix workload of `pagedattn bench engine --shared-prefix N`: requests over one
long cached prefix (a system prompt), decoded with cascade attention and without.

`batch` requests, each the same `prefix_len` random tokens then `suffix_len` tokens of its own,
`output_len` greedy tokens (EOS ignored), on one engine: the prefix alone first (its blocks
cached), then the batch, three times: with cascade attention (decode steps replayed from its
cascade graphs where the engine has them), without it (from its decode graphs) and without it
eagerly (the graphs set aside), so the cascade's gain and the graphs' show apart. Per mode: the pure decode steps (every request running with a token of its own, none
finished) timed on the host, their median; the steps the policy cascaded; the tokens. Then token
equality of each mode against the cascade's, and at each request's first divergence both
candidates' log-probabilities on both sides: a near tie (within NEAR_TIE on both sides, as
random weights' flat distributions give in bf16), or not.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from pagedattn.engine.sampling_params import SamplingParams

MODES = ("cascade", "whole", "whole_eager")
NEAR_TIE = 0.1  # nats: a divergence where both runs' two candidates lie this close is a tie in bf16


class _CountingPolicy:
    """The runner's cascade policy, recording the blocks it decides for each step."""

    def __init__(self, policy):
        self.policy = policy
        self.decided: list[int] = []

    def prefix_blocks(self, *args) -> int:
        n = self.policy.prefix_blocks(*args)
        self.decided.append(n)
        return n


def shared_prefix_prompts(*, prefix_len: int, suffix_len: int, batch: int, vocab_size: int,
                          seed: int) -> tuple[list[int], list[list[int]]]:
    """(the prefix, the batch's prompts: the prefix then `suffix_len` tokens each)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (prefix_len + batch * suffix_len,), generator=gen).tolist()
    prefix = ids[:prefix_len]
    return prefix, [prefix + ids[prefix_len + i * suffix_len: prefix_len + (i + 1) * suffix_len]
                    for i in range(batch)]


def run_shared_prefix(engine, *, prefix_len: int, suffix_len: int = 128, output_len: int = 128, batch: int = 64,
                      seed: int = 0) -> dict:
    """The workload (module docstring) on `engine` (an `LLMEngine` whose cascade policy is on):
    {mode: {median_step_s, p10/p90, steps_timed, cascade_steps, steps}, "equal": ...}."""
    runner = engine.runner
    policy, graphs = runner.cascade, runner.graphs
    if not policy.enabled or policy.refusal:
        raise ValueError(f"expected an engine with cascade attention on, got {policy}")
    prefix, prompts = shared_prefix_prompts(prefix_len=prefix_len, suffix_len=suffix_len, batch=batch,
                                            vocab_size=engine.spec.vocab_size, seed=seed)
    engine.generate([prefix], [SamplingParams(temperature=0, max_tokens=1)])  # the prefix's blocks cached
    result: dict = {"prefix_len": prefix_len, "suffix_len": suffix_len, "output_len": output_len, "batch": batch,
                    "graphs": graphs is not None, "cascade_graphs": graphs is not None and graphs.has_cascade}
    runs = {}
    try:
        for mode in MODES:
            counting = _CountingPolicy(dataclasses.replace(policy, enabled=mode == "cascade"))
            runner.cascade = counting
            runner.graphs = None if mode == "whole_eager" else graphs
            runs[mode] = _decode(engine, prompts, output_len)
            runs[mode]["cascade_steps"] = sum(n > 0 for n in counting.decided)
            runs[mode]["steps"] = len(counting.decided)
    finally:
        runner.cascade, runner.graphs = policy, graphs
    for mode, run in runs.items():
        result[mode] = {k: v for k, v in run.items() if k != "outputs"}
    for mode in MODES[1:]:
        result[f"equal_{mode}"] = compare(runs["cascade"]["outputs"], runs[mode]["outputs"])
    return result


def _decode(engine, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, logprobs=5)
    groups = [engine.add_request(p, params) for p in prompts]
    ids = [g.request_id for g in groups]
    generated = dict.fromkeys(ids, 0)
    finished: dict[str, object] = {}
    times = []
    while engine.has_unfinished():
        stats = engine.stats()
        pure = not finished and min(generated.values()) > 0 and stats.num_running == len(prompts)
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        if pure:
            times.append(elapsed)
        for out in outs:
            generated[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                finished[out.request_id] = out
    if not times:
        raise RuntimeError(f"expected pure decode steps of {len(prompts)} requests, got none")
    q = statistics.quantiles(times, n=10) if len(times) > 1 else [times[0]] * 9
    return {"median_step_s": statistics.median(times), "p10_step_s": q[0], "p90_step_s": q[-1],
            "steps_timed": len(times), "outputs": [finished[i] for i in ids]}


def compare(a: list, b: list) -> dict:
    """Greedy outputs of two runs (`RequestOutput`s with top-5 log-probabilities): how many are
    equal; at each divergence, its position and both candidates' log-probabilities on both sides."""
    diverged = []
    for i, (x, y) in enumerate(zip(a, b)):
        tx, ty = x.outputs[0].token_ids, y.outputs[0].token_ids
        if tx == ty:
            continue
        j = next((k for k, (p, q) in enumerate(zip(tx, ty)) if p != q), min(len(tx), len(ty)))
        row = {"request": i, "position": j}
        if j < min(len(tx), len(ty)):
            lx, ly = x.outputs[0].logprobs[j], y.outputs[0].logprobs[j]
            row.update(tokens=(tx[j], ty[j]),
                       logprobs_a={t: _lp(lx, t) for t in (tx[j], ty[j])},
                       logprobs_b={t: _lp(ly, t) for t in (tx[j], ty[j])})
            gaps = [_gap(lx, tx[j], ty[j]), _gap(ly, ty[j], tx[j])]  # each run's margin for its own choice
            row["gaps"] = gaps
            row["near_tie"] = all(g is not None and g <= NEAR_TIE for g in gaps)
        diverged.append(row)
    return {"equal": len(a) - len(diverged), "of": len(a), "near_ties": sum(d.get("near_tie", False) for d in diverged),
            "diverged": diverged}


def _gap(logprobs: dict, chosen: int, other: int) -> float | None:
    a, b = _lp(logprobs, chosen), _lp(logprobs, other)
    return None if a is None or b is None else a - b


def _lp(logprobs: dict, token: int) -> float | None:
    entry = logprobs.get(token)
    return None if entry is None else entry.logprob
