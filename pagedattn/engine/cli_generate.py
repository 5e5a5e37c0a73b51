"""`pagedattn generate`: answer prompts, streaming one answer or showing progress over many."""

from __future__ import annotations

import sys
import time

from pagedattn.engine.config import EngineConfig
from pagedattn.engine.llm_engine import LLMEngine
from pagedattn.engine.sampling_params import SamplingParams


def generate_main(args) -> int:
    """args: `prompts` (list of str), `model`, `backend`, `device`, `max_tokens`, and optionally
    `temperature` (default 0: greedy) and `no_chat_template`. Returns the exit status."""
    engine = LLMEngine(EngineConfig(model=args.model, backend=args.backend, device=args.device))
    params = SamplingParams(temperature=getattr(args, "temperature", 0.0), max_tokens=args.max_tokens)
    use_template = not getattr(args, "no_chat_template", False) and engine.spec.has_chat_template
    prompts = [_chat(engine.tokenizer, p) if use_template else p for p in args.prompts]
    start = time.perf_counter()
    if len(prompts) == 1:
        outputs = [_stream(engine, prompts[0], params)]
    else:
        outputs = engine.generate(prompts, [params] * len(prompts), use_tqdm=True)
        for question, out in zip(args.prompts, outputs):
            print(f"### {question}\n{out.outputs[0].text}\n")
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    failed = [o for o in outputs if o.error is not None]
    for o in failed:
        print(f"error: {o.error}", file=sys.stderr)
    print(f"[{tokens} tokens in {elapsed:.2f} s: {tokens / max(elapsed, 1e-9):.1f} tokens/s]", file=sys.stderr)
    return 1 if failed else 0


def _chat(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _stream(engine: LLMEngine, prompt, params: SamplingParams):
    group = engine.add_request(prompt, params)
    printed = 0
    result = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != group.request_id or not out.outputs:
                continue
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
            result = out
    sys.stdout.write("\n")
    return result
