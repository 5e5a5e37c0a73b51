"""Engine throughput and memory: `pagedattn.LLM` vs transformers' `generate` on one model.

Each (implementation, batch size) runs in a fresh subprocess, so its peak resident set size
(`ru_maxrss`) is its own. Both sides get the same token ids (the chat template applied and
tokenized once, by the same call), the same torch thread count, and the same dtype (float32 on
the CPU, the model's bf16 on CUDA); both decode greedily for exactly `MAX_TOKENS` new tokens
(EOS ignored). Both warm up once on a prompt unlike the timed ones, then time `REPEATS` runs
and report the median: generated tokens per second of wall time, prefill included. Our prefix
cache is off, so a repeated run recomputes its prompts as transformers does.

Run: `pagedattn bench engine [--device cpu|cuda] [--out rows.json]`.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from pagedattn.benchmarks import require_cuda

MAX_TOKENS = 64
REPEATS = 3
BATCHES = (1, 16)
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a paged KV cache is in one paragraph.",
    "List three prime numbers.",
]
WARMUP_PROMPT = "Warm-up: count from one to ten."


def _prompts(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] + f" (request {i})" for i in range(n)]


def _token_ids(tok, texts: list[str]) -> list[list[int]]:
    """The chat-templated prompts as token ids, exactly as both sides consume them."""
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
             for t in texts]
    return [tok(c, add_special_tokens=False)["input_ids"] for c in chats]


def _ours(batch: int, device: str) -> dict:
    import pagedattn

    llm = pagedattn.LLM(device=device, dtype="float32" if device == "cpu" else "auto", enable_prefix_caching=False)
    prompts = _token_ids(llm.tokenizer, _prompts(batch))
    warmup = llm.tokenizer(WARMUP_PROMPT)["input_ids"]
    llm.generate([warmup], pagedattn.SamplingParams(temperature=0.0, max_tokens=4))
    params = pagedattn.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        runs.append(time.perf_counter() - start)
    return {"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": _median(runs), "runs": runs}


def _transformers(batch: int, device: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedattn.models.default import default_model_path

    path = default_model_path()
    folder, name = str(path.parent), path.name
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).to(device).eval()
    ids = _token_ids(tok, _prompts(batch))
    enc = tok.pad({"input_ids": ids}, return_tensors="pt").to(device)  # left padding, attention mask
    warmup = tok(WARMUP_PROMPT, return_tensors="pt").to(device)
    kw = dict(max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)
    runs = []
    with torch.inference_mode():
        model.generate(**warmup, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        for _ in range(REPEATS):
            start = time.perf_counter()
            out = model.generate(**enc, **kw)
            runs.append(time.perf_counter() - start)
    return {"tokens": (out.shape[1] - enc["input_ids"].shape[1]) * batch, "seconds": _median(runs), "runs": runs}


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _child(impl: str, batch: int, device: str, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    result = (_ours if impl == "pagedattn" else _transformers)(batch, device)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["threads"] = torch.get_num_threads()
    print(json.dumps(result))


def run_engine_benchmark(out_path: str | None, device: str = "cpu") -> int:
    import torch

    threads = torch.get_num_threads()  # torch's default here (the physical cores), for both sides
    rows = []
    for batch in BATCHES:
        for impl in ("pagedattn", "transformers"):
            proc = subprocess.run(
                [sys.executable, "-m", "pagedattn.benchmarks.engine", "--device", device,
                 "--child", impl, str(batch), str(threads)],
                capture_output=True, text=True, check=False,
            )
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r.update(impl=impl, batch=batch, tokens_per_s=r["tokens"] / r["seconds"])
            rows.append(r)
    print(f"{MAX_TOKENS} new tokens per request, greedy, {threads} torch threads on {device}, "
          f"median of {REPEATS} runs")
    print(f"{'batch':>5} {'impl':<13} {'tokens/s':>9} {'peak RSS MiB':>13}")
    for r in rows:
        print(f"{r['batch']:>5} {r['impl']:<13} {r['tokens_per_s']:>9.1f} {r['peak_rss_mib']:>13.0f}")
    for batch in BATCHES:
        ours, theirs = (next(r for r in rows if r["batch"] == batch and r["impl"] == i) for i in ("pagedattn", "transformers"))
        print(f"batch {batch}: speed {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x, "
              f"memory {ours['peak_rss_mib'] / theirs['peak_rss_mib']:.2f}x of transformers")
    if out_path:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", default=None, help="also write the rows to this JSON file")
    # one (implementation, batch, threads) measurement, run by run_engine_benchmark in its own process
    parser.add_argument("--child", nargs=3, metavar=("IMPL", "BATCH", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda"):
        require_cuda(parser.prog)
    if args.child:
        impl, batch, threads = args.child
        _child(impl, int(batch), args.device, int(threads))
        return 0
    return run_engine_benchmark(args.out, args.device)


if __name__ == "__main__":
    raise SystemExit(main())
