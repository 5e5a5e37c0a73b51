"""Engine throughput on a GPU: `pagedattn.LLM` vs transformers' continuous batching
(`generate_batch`) on a small random Llama made on the spot (no weights are downloaded).

64 prompts of 128 random tokens, 128 new tokens each, greedy, EOS ignored, bf16; tokens/s of
wall time after a warm-up. Run: `pagedattn bench engine-gpu [--backend B]`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from pagedattn.benchmarks import require_cuda

CONFIG = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
BATCH, PROMPT_LEN, NEW_TOKENS = 64, 128, 128


def _make_model(folder: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16).eval()
    model.save_pretrained(folder, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(CONFIG["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2").save_pretrained(folder)
    return model


def _ours(folder: str, prompts: list[list[int]], backend: str) -> float:
    import pagedattn

    llm = pagedattn.LLM(folder, backend=backend, device="cuda", dtype="bfloat16", max_num_seqs=BATCH)
    params = pagedattn.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate(prompts[:BATCH], pagedattn.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def _transformers(model, prompts: list[list[int]]) -> float:
    from transformers import GenerationConfig

    model = model.cuda()
    cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0,
                           use_cuda_graph=True)
    model.generate_batch(prompts[:8], generation_config=GenerationConfig(max_new_tokens=8, do_sample=False,
                                                                         eos_token_id=-1, pad_token_id=0))
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = model.generate_batch(prompts, generation_config=cfg)
    torch.cuda.synchronize()
    return sum(len(o.generated_tokens) for o in outs.values()) / (time.perf_counter() - start)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="triton")
    args = parser.parse_args(argv)
    require_cuda(parser.prog)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, CONFIG["vocab_size"], (PROMPT_LEN,), generator=gen).tolist() for _ in range(BATCH)]
    with tempfile.TemporaryDirectory() as folder:
        model = _make_model(folder)
        ours = _ours(folder, prompts, args.backend)
        try:
            theirs, how = _transformers(model, prompts), "generate_batch"
        except Exception as e:  # report, do not hide: the peer's API moves between versions
            theirs, how = float("nan"), f"generate_batch failed: {type(e).__name__}: {e}"
    print(json.dumps({"batch": BATCH, "backend": args.backend, "ours_tokens_per_s": round(ours, 1),
                      "transformers_tokens_per_s": round(theirs, 1), "transformers": how,
                      "ratio": round(ours / theirs, 2) if theirs == theirs else None}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
