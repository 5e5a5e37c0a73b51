"""Offline runs of `pagedattn bench engine`: workloads, timed runs of our engine (transformers'
`generate_batch`: `transformers_runner`), the decode step against its bandwidth floor, the copy bandwidth.

A workload is (input length, output length) per request: fixed, or drawn from `SHAREGPT`. A cell
(workload, batch) submits `batch` requests at once and times until the last one finishes: output
tokens per second of wall time, prefill included. Each repetition draws new random prompt ids
(the same lengths), so no prefix cache helps a later repetition, on either side.
"""

from __future__ import annotations

import math
import statistics
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedattn.engine.sampling_params import SamplingParams

FIXED = {"128/128": (128, 128), "1024/128": (1024, 128), "128/1024": (128, 1024)}
"""Fixed workloads: name -> (input tokens, output tokens) of every request."""


@dataclass(frozen=True)
class LengthDistribution:
    """Log-normal request lengths, like ShareGPT conversations (a long tail of long prompts):
    length = round(median * exp(sigma * N(0, 1))), clipped to [min_len, max_*]."""

    input_median: float = 160
    input_sigma: float = 1.0
    output_median: float = 140
    output_sigma: float = 0.8
    min_len: int = 4
    max_input: int = 2048
    max_output: int = 1024


SHAREGPT = LengthDistribution()
WORKLOADS = (*FIXED, "sharegpt")


@dataclass(frozen=True)
class Request:
    prompt: list[int]  # token ids
    max_tokens: int  # output tokens, EOS ignored


@dataclass(frozen=True)
class Run:
    seconds: float
    generated: int  # output tokens of every request


def request_lengths(workload: str, n: int, *, max_model_len: int, seed: int,
                    dist: LengthDistribution = SHAREGPT) -> list[tuple[int, int]]:
    """(input, output) tokens of `n` requests; drawn lengths are cut so prompt + output fit the
    context (the output first to leave `min_len` prompt tokens, then the prompt)."""
    if workload in FIXED:
        inp, out = FIXED[workload]
        if inp + out > max_model_len:
            raise ValueError(
                f"expected workload {workload} to fit max_model_len={max_model_len}, got {inp + out} tokens")
        return [(inp, out)] * n
    if workload != "sharegpt":
        raise ValueError(f"expected a workload in {list(WORKLOADS)}, got {workload!r}")
    gen = torch.Generator().manual_seed(_stable_seed(seed, workload, n))
    normal = torch.randn(2, n, generator=gen, dtype=torch.float64)
    lengths = []
    for a, b in normal.T.tolist():
        out = min(max(round(dist.output_median * math.exp(dist.output_sigma * b)), dist.min_len), dist.max_output,
                  max_model_len - dist.min_len)
        inp = min(max(round(dist.input_median * math.exp(dist.input_sigma * a)), dist.min_len), dist.max_input)
        lengths.append((min(inp, max_model_len - out), out))
    return lengths


def make_requests(lengths: list[tuple[int, int]], *, vocab_size: int, seed: int, rep: int) -> list[Request]:
    """Random prompts of the given lengths; `rep` (-1: the warm-up) picks fresh ids per run."""
    gen = torch.Generator().manual_seed(_stable_seed(seed, len(lengths), sum(i for i, _ in lengths), rep))
    ids = torch.randint(0, vocab_size, (sum(i for i, _ in lengths),), generator=gen).tolist()
    out, start = [], 0
    for inp, n in lengths:
        out.append(Request(ids[start : start + inp], n))
        start += inp
    return out


def _stable_seed(*parts) -> int:
    # hash() of a str changes between processes; crc32 does not
    return zlib.crc32("/".join(map(str, parts)).encode())


def sync(device: torch.device) -> None:
    """Wait for the device (CUDA) before a clock is read."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------- the two sides


def run_ours(engine, requests: list[Request]) -> Run:
    """All requests queued at once on an `LLMEngine`, stepped until every one finished."""
    sync(engine.device)
    start = time.perf_counter()
    for r in requests:
        engine.add_request(r.prompt, SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True))
    generated = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                generated += len(out.outputs[0].token_ids)
    sync(engine.device)
    return Run(time.perf_counter() - start, generated)


# ---------------------------------------------------------------------- a cell


def measure(run_once: Callable[[int], Run], reps: int, max_cell_s: float, tick: Callable[[], None]) -> dict:
    """A warm-up run (rep -1), then up to `reps` timed runs; `run_once(rep)` runs one. The timed
    runs are cut to what fits `max_cell_s` at the warm-up's pace (a note says so); a warm-up
    longer than `max_cell_s` stands alone, untimed runs none. `tick` after each planned run."""
    warm = run_once(-1)
    tick()
    fit = reps if warm.seconds * reps <= max_cell_s else int(max_cell_s // warm.seconds)
    if fit == 0:
        for _ in range(reps):
            tick()
        return {"runs_s": [], "generated": warm.generated, "median_s": warm.seconds, "spread": None,
                "tokens_per_s": warm.generated / warm.seconds,
                "note": f"warm-up {warm.seconds:.0f} s > --max-cell-s {max_cell_s:g}: the warm-up run alone"}
    runs = []
    for rep in range(reps):
        if rep < fit:
            runs.append(run_once(rep))
        tick()
    seconds = [r.seconds for r in runs]
    median = statistics.median(seconds)
    generated = runs[0].generated
    return {"runs_s": [round(x, 5) for x in seconds], "generated": generated, "median_s": median,
            "spread": (max(seconds) - min(seconds)) / median if len(runs) > 1 else None,
            "tokens_per_s": generated / median,
            "note": f"{fit} of {reps} repetitions (--max-cell-s {max_cell_s:g})" if fit < reps else ""}


# ---------------------------------------------------------------------- the decode step and its floor


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once, except an embedding table
    that is not also the output head (a step gathers only its batch's rows of it), and the
    CPU-packed linears' weights (oneDNN tensors outside the parameters). With tensor
    parallelism `model` is one rank's shard: what that rank reads."""
    names: dict[int, list[str]] = {}
    sizes: dict[int, int] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p.data_ptr(), []).append(name)
        sizes[p.data_ptr()] = p.numel() * p.element_size()
    packed = sum(m.weight.shape.numel() * m.weight.dtype.itemsize for m in model.modules()
                 if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.is_mkldnn)
    return packed + sum(size for ptr, size in sizes.items()
                        if not (len(names[ptr]) == 1 and "embed_tokens" in names[ptr][0]))


def kv_bytes_per_token(spec, cache_dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
    """K and V of one token in every layer's cache (of `num_kv_heads` heads: one rank's; None:
    the model's)."""
    heads = spec.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * spec.num_layers * heads * spec.head_size * cache_dtype.itemsize


def decode_step(engine, *, batch: int, prompt_len: int, steps: int, seed: int, weight_bytes: int,
                bandwidth: float) -> dict:
    """Time every `engine.step()` of `batch` requests (prompt `prompt_len`, `steps` + 1 output
    tokens); a step counts as a pure decode step of the whole batch when, before it, every
    request has its first token, all are running and none has finished. Its floor: the weights plus the K/V of
    every context token (at the median step) read once at `bandwidth` bytes/s; with tensor parallelism, one
    rank's (`weight_bytes` of its shard, its KV heads), since the ranks read theirs at once. `graph_replay_s`: the
    model's and output head's device time alone (its CUDA graph replayed mid-run; None without graphs), so the
    step's remainder is sampling and host work not hidden behind the device."""
    spec = engine.spec
    per_token = kv_bytes_per_token(spec, engine.runner.cache_dtype, engine.runner.num_kv_heads)  # one rank's
    lengths = [(prompt_len, steps + 1)] * batch
    requests = make_requests(lengths, vocab_size=spec.vocab_size, seed=seed, rep=-2)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    ids = [engine.add_request(r.prompt, params).request_id for r in requests]
    generated = dict.fromkeys(ids, 0)
    finished: set[str] = set()
    times, contexts = [], []
    replay = None
    while engine.has_unfinished():
        stats = engine.stats()  # none preempted (waiting again, or swapped out)
        pure = not finished and min(generated.values()) > 0 and stats.num_running == batch
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        if pure:
            times.append(elapsed)
            contexts.append(sum(prompt_len + g for g in generated.values()))
            if len(times) == steps // 2:  # mid-run, requests still running: the graph's device time alone
                replay = engine.runner.time_decode_graph(batch)
        for out in outs:
            generated[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                finished.add(out.request_id)
    if not times:
        raise RuntimeError(f"expected pure decode steps of {batch} requests, got none (is max_num_seqs < {batch}?)")
    step = statistics.median(times)
    context = statistics.median(contexts)
    floor = (weight_bytes + per_token * context) / bandwidth
    q = statistics.quantiles(times, n=10) if len(times) > 1 else [step] * 9
    return {"batch": batch, "steps_timed": len(times), "median_step_s": step, "p10_step_s": q[0],
            "p90_step_s": q[-1], "median_context_tokens": context, "weight_bytes": weight_bytes,
            "kv_bytes": per_token * context, "floor_s": floor, "ratio_to_floor": step / floor,
            "graph_replay_s": replay}


def copy_bandwidth(device: torch.device, nbytes: int, copies: int = 10, trials: int = 5) -> float:
    """Bytes/s of device-to-device copies of `nbytes` (each read once and written once): the
    median of `trials` timings of `copies` back-to-back copies (one synchronisation per trial)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(trials):
        sync(device)
        start = time.perf_counter()
        for _ in range(copies):
            dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    del src, dst
    return 2 * nbytes * copies / statistics.median(times)
