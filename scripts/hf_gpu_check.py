"""pagedattn inside transformers on a CUDA GPU: greedy tokens at bf16, and the generate_batch row.

    python scripts/hf_gpu_check.py OUT_DIR

Random weights only (`pagedattn.models.dummy`), nothing downloaded. Writes OUT_DIR/hf_gpu_check.log
(what is printed) and OUT_DIR/hf_gpu_check.json, and the bench's files in OUT_DIR/bench.
1. Tiny Llama, Qwen2 and Gemma 2 (window 8 every other layer, soft cap 5, 4:1 GQA), bf16: greedy
   tokens of `generate` (three prompts, left-padded) with `register()`'s attention (our Triton
   kernels) against transformers' sdpa (eager for Gemma 2), and of `generate_batch` against
   `paged|eager` where the installed transformers runs it on a registered attention (5.1-5.18).
   Where tokens differ: the first position that does, and the reference's logit gap there
   (its top token's logit minus the logit of ours, from a forward pass over the prompt and the
   tokens both agree on). bf16 allows a divergence where that gap is within `BF16_GAP`.
2. `pagedattn bench engine --hf-attention` at the Llama-3-8B shape, 64 requests of 128 + 128
   tokens, one timed run after a warm-up: tokens/s of generate_batch on ours, on sdpa (transformers'
   paged default) and on paged|eager.
Exit code 0 when every family passes, else 1.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from pathlib import Path

import torch

FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-gemma2")
NEW_TOKENS = 24
BF16_GAP = 0.25  # logits of |x| ~ 10-30 in bf16 round by ~0.06-0.125: a smaller gap is a tie


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, s):
        for st in self.streams:
            st.write(s)
            st.flush()
        return len(s)


def _prompts(seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (7, 19, 13)]


def _reference(model) -> str:
    return "sdpa" if model._supports_sdpa else "eager"


def _divergence(model, ref_impl: str, prompt: list[int], ref: list[int], ours: list[int]) -> dict | None:
    """None when equal; else the first differing position and the reference's logit gap there."""
    i = next((j for j, (a, b) in enumerate(zip(ref, ours)) if a != b), None)
    if i is None:
        return None
    model.set_attn_implementation(ref_impl)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:i]], device=model.device)).logits[0, -1].float()
    top2 = logits.topk(2).values
    return {"position": i, "ref_token": ref[i], "our_token": ours[i],
            "gap_to_ours": float(logits[ref[i]] - logits[ours[i]]), "ref_top2_gap": float(top2[0] - top2[1]),
            "within_bf16": float(logits[ref[i]] - logits[ours[i]]) <= BF16_GAP}


def check_family(shape: str, name: str) -> dict:
    from transformers import GenerationConfig

    from pagedattn.benchmarks.transformers_runner import TransformersRunner
    from pagedattn.integrations.transformers import generate_batch_unavailable_reason
    from pagedattn.models.dummy import load_dummy_model, transformers_model

    model = transformers_model(load_dummy_model(shape, device="cuda", dtype=torch.bfloat16, seed=0))
    ref_impl, prompts = _reference(model), _prompts()
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = (ids != 0).long()  # prompts hold no id 0
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    result = {"shape": shape, "reference": ref_impl, "generate": [], "generate_batch": []}
    tokens = {}
    for impl in (ref_impl, name):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(ids, attention_mask=mask, generation_config=config)[:, width:].tolist()
    for p, r, o in zip(prompts, tokens[ref_impl], tokens[name]):
        result["generate"].append(_divergence(model, ref_impl, p, r, o))
    why = generate_batch_unavailable_reason()
    if why:
        result["generate_batch_skipped"] = why
    else:
        batch = {}
        for impl in ("paged|eager", name):
            model.set_attn_implementation(impl)
            batch[impl] = TransformersRunner(model, num_blocks=256, max_batch_tokens=256,
                                             persistent=False).generate(prompts, NEW_TOKENS)
        for p, r, o in zip(prompts, batch["paged|eager"], batch[name]):
            result["generate_batch"].append(_divergence(model, "paged|eager", p, r, o))
    checks = result["generate"] + result["generate_batch"]
    result["equal"] = sum(d is None for d in checks)
    result["compared"] = len(checks)
    result["ok"] = all(d is None or d["within_bf16"] for d in checks)
    del model
    torch.cuda.empty_cache()
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("expected a CUDA GPU, found none", file=sys.stderr)
        return 2
    log = (out / "hf_gpu_check.log").open("w")
    with contextlib.redirect_stdout(_Tee(sys.stdout, log)):
        import transformers

        import pagedattn.integrations.transformers as pa_hf
        from pagedattn.benchmarks import engine

        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}")
        name = pa_hf.register()
        print(f"attn_implementation={name}; generate_batch: {pa_hf.generate_batch_unavailable_reason() or 'runs'}")
        summary = {"name": name, "transformers": transformers.__version__, "families": []}
        for shape in FAMILIES:
            start = time.perf_counter()
            try:
                r = check_family(shape, name)
            except Exception as e:  # noqa: BLE001 - report it, check the other families
                r = {"shape": shape, "ok": False, "equal": 0, "compared": 0, "generate": [], "generate_batch": [],
                     "error": f"{type(e).__name__}: {e}"}
                print(f"  {shape}: {r['error']}")
            summary["families"].append(r)
            print(f"{shape}: {r['equal']}/{r['compared']} sequences equal, "
                  f"{'ok' if r['ok'] else 'FAILED'} ({time.perf_counter() - start:.0f} s)")
            for part in ("generate", "generate_batch"):
                for i, d in enumerate(r[part]):
                    if d is not None:
                        print(f"  {part} prompt {i}: first divergence at token {d['position']} "
                              f"(ref {d['ref_token']}, ours {d['our_token']}), reference logit gap "
                              f"{d['gap_to_ours']:.4f} (top-2 gap {d['ref_top2_gap']:.4f})")
            if "generate_batch_skipped" in r:
                print(f"  generate_batch skipped: {r['generate_batch_skipped']}")
        print("bench: generate_batch at the Llama-3-8B shape, 64 x 128/128")
        code = engine.main(["--model-shape", "llama3-8b", "--hf-attention", "--workloads", "128/128",
                            "--batches", "64", "--reps", "1", "--out", str(out / "bench")], "pagedattn bench engine")
        summary["bench"] = json.loads((out / "bench" / "engine_bench.json").read_text())["offline"]
        (out / "hf_gpu_check.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        ok = all(r["ok"] for r in summary["families"]) and code == 0
        print("hf_gpu_check: " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
