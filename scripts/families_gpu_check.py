"""On a GPU: Qwen3, Gemma 3 and gpt-oss (and Gemma 2, the other model of windowed and full
layers) through `pagedattn.LLM` against transformers' `generate`, greedy, on the same random
weights (made here: nothing is downloaded), in bf16 by default.

Per family and backend, each prompt's tokens are compared; where they first differ, the
position and both models' logit gaps there are printed: transformers' (its logit of its token
minus its logit of ours) and ours (our logprob of our token minus our logprob of its token).
A difference whose transformers gap is under --tie-gap is a near-tie that bf16 rounding may
break either way; a larger one fails. A backend that refuses a family at construction (gpt-oss's
sinks on backends without them) is reported with its reason.

Below float32 a difference is also judged against the float32 truth: the same transformers
model in float32 gives each prompt's next-token log-probabilities, and our error there (the
largest |ours - truth| over our top 20) is set beside transformers' own error at the model
dtype. A random mixture of experts in bf16 can route a token differently from float32 on a
rounding, so transformers' bf16 and ours may both leave the float32 choice; ours is within
bf16 tolerance when its error is no more than --error-ratio times transformers' (or below
0.05). A prompt passes on equal tokens, a near-tie, or that. `--error-prompts N` adds N random
prompts (30-700 tokens) judged on their first token only, summed up: both errors' mean and
median, and on how many each side's error passes the ratio times the other's; one prompt's
verdict is a coin toss where bf16 routes experts apart, the sums are not. The engine runs as in production:
CUDA graphs (unless --enforce-eager), chunked prefill, the prefix cache (the last prompt shares
most of the first one's tokens and runs after it), KV cache groups for the hybrid families.

    python scripts/families_gpu_check.py [--backend torch,triton] [--families qwen3,gemma3,gpt_oss,gemma2]
        [--size medium|tiny] [--dtype bfloat16|float32] [--max-tokens 32] [--tie-gap 0.25] [--error-ratio 1.25]
        [--enforce-eager] [--error-prompts 0]
        [--device cuda]    (--device cpu --size tiny --dtype float32 --backend torch: a smoke run of the script)

Exit status 0 when every family and backend that ran passed (refusals are listed, not failures), 1 otherwise.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import tempfile

import torch

import pagedattn

WINDOW = {"tiny": 8, "medium": 64}
SIZES = {
    "tiny": dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "medium": dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=64),
}
PROMPT_LENS = {"tiny": (5, 23, 40, 61), "medium": (40, 150, 300, 700)}


def family_config(family: str, size: str):
    """transformers' config of `family` at `size`, windows small enough to matter in the prompts."""
    import transformers

    base = dict(SIZES[size], max_position_embeddings=2048, bos_token_id=256, eos_token_id=257)
    window = WINDOW[size]
    if family == "qwen3":
        return transformers.Qwen3Config(**base | dict(head_dim=2 * base["head_dim"], tie_word_embeddings=False))
    if family == "gemma3":
        layers = 6 if size == "medium" else 3  # the released pattern: five local layers per global one
        return transformers.Gemma3TextConfig(**base | dict(
            num_hidden_layers=layers, head_dim=4 * base["head_dim"] if size == "medium" else 16,
            query_pre_attn_scalar=256, sliding_window=window,
            layer_types=["full_attention" if (i + 1) % 6 == 0 or i == layers - 1 else "sliding_attention"
                         for i in range(layers)],
            rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                             "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0)},
        ))
    if family == "gpt_oss":
        return transformers.GptOssConfig(**base | dict(
            sliding_window=window, num_local_experts=8, num_experts_per_tok=2,
            rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=16.0, beta_fast=32.0, beta_slow=1.0,
                                 truncate=False, original_max_position_embeddings=128),
        ))
    if family == "gemma2":
        return transformers.Gemma2Config(**base | dict(query_pre_attn_scalar=base["head_dim"], sliding_window=window,
                                                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0))
    raise ValueError(f"expected a family in qwen3, gemma3, gpt_oss, gemma2, got {family!r}")


@torch.no_grad()
def randomise(model, gemma: bool) -> None:
    """Weights of unit-scale activations: peaked next-token distributions (random ones of
    transformers' 0.02 init are nearly flat, where bf16 breaks every tie)."""
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            p.copy_((0.0 if gemma else 1.0) + 0.1 * noise)
        elif "sinks" in name or p.dim() == 1 or name.endswith("_bias"):
            p.copy_(0.3 * noise)
        else:  # [out, in] linears and embeddings; experts [E, in, out]
            fan_in = p.shape[1] if p.dim() == 3 else p.shape[-1]
            p.copy_(noise * (1.5 / math.sqrt(fan_in)))


def save_reference(family: str, size: str, folder: str):
    """Save a random checkpoint of `family` with the byte tokenizer; transformers' model on it."""
    import transformers

    sys.path.insert(0, "tests")
    from tiny_models import byte_tokenizer

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(family_config(family, size), attn_implementation="eager",
                                                          dtype=torch.float32)
    randomise(model, gemma=family.startswith("gemma"))
    model.save_pretrained(folder, safe_serialization=True)
    byte_tokenizer().save_pretrained(folder)
    model.generation_config.eos_token_id = None
    return model.eval()


def prompts_of(size: str) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS[size]]
    shared = prompts[-1][: len(prompts[-1]) * 3 // 4] + torch.randint(0, 256, (5,), generator=gen).tolist()
    return prompts + [shared]  # the last one runs alone, after the others: a prefix-cache hit


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens, pad_token_id=0, eos_token_id=None, output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [x[0].float() for x in out.logits]


def compare(ours, theirs: list[int], their_logits: list[torch.Tensor], tie_gap: float) -> tuple[bool, str]:
    """(passed, a line): equal, or the first difference and both gaps there."""
    mine = list(ours.token_ids)
    if mine == theirs:
        return True, f"equal ({len(mine)} tokens)"
    i = next(k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b)
    logits = their_logits[i]
    their_gap = (logits[theirs[i]] - logits[mine[i]]).item()
    top = ours.logprobs[i] if ours.logprobs else {}
    our_gap = f"{top[mine[i]].logprob - top[theirs[i]].logprob:.4f}" if theirs[i] in top else "> top-5"
    ok = their_gap < tie_gap
    return ok, (f"first difference at token {i} of {len(theirs)}: ours {mine[i]}, transformers' {theirs[i]}; "
                f"gap transformers {their_gap:.4f}, ours {our_gap} ({'near-tie' if ok else 'FAIL'})")


@torch.no_grad()
def next_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """The model's log-probabilities of the token after `prompt` [vocab], float32 on the CPU."""
    logits = model(torch.tensor([prompt], device=model.device)).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def error_against_truth(ours, prompt: list[int], truth, theirs_model) -> tuple[float, float]:
    """(ours, transformers'): the largest |logprob - float32 truth| over our first token's top
    log-probabilities, ours and transformers' at the model dtype."""
    top = ours.logprobs[0]
    ids = list(top)
    exact = next_logprobs(truth, prompt)[ids]
    mine = torch.tensor([top[t].logprob for t in ids])
    theirs = next_logprobs(theirs_model, prompt)[ids]
    return (mine - exact).abs().max().item(), (theirs - exact).abs().max().item()


def check(family: str, backend: str, a) -> str:
    """"passed", "failed" or "refused" (the backend cannot build the family here)."""
    with tempfile.TemporaryDirectory() as folder:
        reference = save_reference(family, a.size, folder)
        truth = reference.to(a.device) if a.dtype != "float32" else None  # float32, before the cast below
        if truth is not None:
            import copy

            reference = copy.deepcopy(truth)
        reference = reference.to(a.device, getattr(torch, a.dtype))
        try:
            llm = pagedattn.LLM(folder, backend=backend, device=a.device, dtype=a.dtype, block_size=16,
                                max_model_len=1024, max_num_batched_tokens=256, gpu_memory_utilization=0.4,
                                enforce_eager=a.enforce_eager)
        except (NotImplementedError, ValueError, pagedattn.BackendUnavailableError) as e:
            print(f"{family} on {backend}: refused: {type(e).__name__}: {str(e).splitlines()[0]}")
            return "refused"
        groups = [(g.window, len(g.layers)) for g in llm.engine.runner.kv_groups.groups]
        print(f"{family} on {backend} ({a.dtype}): KV cache groups (window, layers) {groups}, "
              f"{llm.engine.block_manager.num_blocks} blocks")
        params = pagedattn.SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True, logprobs=20)
        prompts = prompts_of(a.size)
        outs = llm.generate(prompts[:-1], params, use_tqdm=False) + llm.generate(prompts[-1:], params, use_tqdm=False)
        passed = True
        for n, (prompt, out) in enumerate(zip(prompts, outs)):
            theirs, logits = hf_greedy(reference, prompt, a.max_tokens)
            ok, line = compare(out.outputs[0], theirs, logits, a.tie_gap)
            if truth is not None:
                mine_err, their_err = error_against_truth(out.outputs[0], prompt, truth, reference)
                within = mine_err <= max(a.error_ratio * their_err, 0.05)
                line += (f"; first token vs float32: error ours {mine_err:.3f}, transformers' {a.dtype} "
                         f"{their_err:.3f} ({'within' if within else 'OUTSIDE'} bf16 tolerance)")
                ok = ok or within
            passed &= ok
            print(f"  prompt {n} ({len(prompt)} tokens): {line}")
        if truth is not None and a.error_prompts:
            print(f"  {error_summary(llm, truth, reference, a)}")
        del llm, reference, truth
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return "passed" if passed else "failed"


def error_summary(llm, truth, reference, a) -> str:
    """First-token errors against float32 over `a.error_prompts` random prompts, ours and
    transformers' at the model dtype, summed up (see the module doc)."""
    import statistics

    gen = torch.Generator().manual_seed(11)
    lens = torch.randint(30, 700, (a.error_prompts,), generator=gen).tolist()
    params = pagedattn.SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    ours, theirs = [], []
    for n in lens:
        prompt = torch.randint(0, 256, (n,), generator=gen).tolist()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        mine, their = error_against_truth(out, prompt, truth, reference)
        ours.append(mine)
        theirs.append(their)
    beyond = sum(m > max(a.error_ratio * t, 0.05) for m, t in zip(ours, theirs))
    their_beyond = sum(t > max(a.error_ratio * m, 0.05) for m, t in zip(ours, theirs))
    return (f"first token vs float32 over {len(lens)} more prompts: error ours mean {statistics.mean(ours):.3f}, "
            f"median {statistics.median(ours):.3f}; transformers' {a.dtype} mean {statistics.mean(theirs):.3f}, "
            f"median {statistics.median(theirs):.3f}; ours above {a.error_ratio}x theirs on {beyond}, theirs above "
            f"{a.error_ratio}x ours on {their_beyond}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="torch,triton", help="comma-separated backend names")
    ap.add_argument("--families", default="qwen3,gemma3,gpt_oss,gemma2")
    ap.add_argument("--size", choices=list(SIZES), default="medium")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tie-gap", type=float, default=0.25, help="largest transformers logit gap of a near-tie")
    ap.add_argument("--error-ratio", type=float, default=1.25,
                    help="largest ratio of our error against float32 to transformers' at the same dtype")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--error-prompts", type=int, default=0,
                    help="below float32: this many more random prompts' first-token errors, summed up")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    if a.error_prompts < 0:
        ap.error(f"--error-prompts: expected a count >= 0, got {a.error_prompts}")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("needs a CUDA device (--device cpu for a smoke run)", file=sys.stderr)
        return 2
    results = {(f, b): check(f, b, a) for f in a.families.split(",") for b in a.backend.split(",")}
    for verdict in ("refused", "failed"):
        names = [f"{f} on {b}" for (f, b), v in results.items() if v == verdict]
        if names:
            print(f"{verdict}: {', '.join(names)}")
    print(f"{sum(v == 'passed' for v in results.values())} of {len(results)} passed")
    return 1 if "failed" in results.values() else 0


if __name__ == "__main__":
    sys.exit(main())
