"""On a GPU: does the engine's start-up warm-up compile every kernel variant that long prompts
meet? Builds a random 2-layer Llama with the heads of a real model (32/8 of 128 by default),
starts `pagedattn.LLM` (which runs the warm-up), then serves long prompts (one past the
step budget, so it arrives in chunks over a growing prefix; one fresh prompt of the whole
budget; decodes at long contexts) inside `CompileLog` and prints the Triton compiles met.

    python scripts/warmup_check.py [--heads 32,8,128] [--max-model-len 16384]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

import pagedattn
from pagedattn.benchmarks.jit_log import CompileLog


def save_model(folder: str, heads: tuple[int, int, int], max_len: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, "tests")
    from tiny_models import TINY_CONFIG, byte_tokenizer

    hq, hkv, d = heads
    config = LlamaConfig(**{**TINY_CONFIG, "hidden_size": hq * d, "intermediate_size": 2 * hq * d,
                            "num_attention_heads": hq, "num_key_value_heads": hkv, "head_dim": d,
                            "max_position_embeddings": max_len})
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    byte_tokenizer().save_pretrained(folder)


def _heads(text: str) -> tuple[int, int, int]:
    try:
        hq, hkv, d = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HQ,HKV,D (e.g. 32,8,128), got {text!r}") from None
    if min(hq, hkv, d) < 1 or hq % hkv:
        raise argparse.ArgumentTypeError(f"expected positive sizes with HQ a multiple of HKV, got {text!r}")
    return hq, hkv, d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="32,8,128", type=_heads, help="query heads, KV heads, head size")
    ap.add_argument("--max-model-len", type=int, default=16384)
    a = ap.parse_args(argv)
    heads = a.heads
    with tempfile.TemporaryDirectory() as folder:
        save_model(folder, heads, a.max_model_len)
        t0 = time.perf_counter()
        llm = pagedattn.LLM(folder, dtype="bfloat16", max_model_len=a.max_model_len, enable_prefix_caching=False)
        print(f"start-up (warm-up included): {time.perf_counter() - t0:.1f} s", flush=True)
        budget = llm.config.max_num_batched_tokens or 8192
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist()
                   for n in (a.max_model_len - 64, min(budget, a.max_model_len - 64), 5000, 300)]
        params = pagedattn.SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        with CompileLog() as log:
            llm.generate(prompts, params)
            llm.generate(prompts[:1] * 3 + prompts[2:], params)
        print(f"compiles after start-up: {len(log.events)} (hooks available: {log.available})")
        for name, at, secs in log.events:
            print(f"  {name} at {at:.1f} s, {secs:.2f} s")
        for v in log.variants:
            print(f"  variant: {v[:300]}")
    return 0 if not log.events else 1


if __name__ == "__main__":
    sys.exit(main())
