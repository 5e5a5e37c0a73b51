"""`pagedattn generate`: answer prompts, streaming one answer or showing progress over many."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine loads transformers: import it only when the command runs
    from pagedattn.engine.llm_engine import LLMEngine
    from pagedattn.engine.sampling_params import SamplingParams

DEFAULT_PROMPT = "What is the capital of France?"


def add_parser(sub) -> None:
    """Register `generate` on `sub`, the `add_subparsers()` object of the `pagedattn` parser."""
    gen = sub.add_parser("generate", help="answer prompts with a model (the embedded default when none is given)")
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help=f"default: {DEFAULT_PROMPT!r}")
    gen.add_argument("--model", default=None, help="a Hugging Face folder or a .gguf file (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--backend", default="auto")
    gen.add_argument("--device", default="auto")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--no-chat-template", action="store_true", help="send the prompts as they are")
    gen.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Answer `args.prompts` (or DEFAULT_PROMPT) with the options above; the exit status is 1 when
    any request failed."""
    from pagedattn.engine.config import EngineConfig
    from pagedattn.engine.llm_engine import LLMEngine
    from pagedattn.engine.sampling_params import SamplingParams

    questions = args.prompts or [DEFAULT_PROMPT]
    engine = LLMEngine(EngineConfig(model=args.model, backend=args.backend, device=args.device))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    use_template = not args.no_chat_template and engine.spec.has_chat_template
    prompts = [_chat(engine.tokenizer, p) if use_template else p for p in questions]
    start = time.perf_counter()
    if len(prompts) == 1:
        outputs = [_stream(engine, prompts[0], params)]
    else:
        outputs = engine.generate(prompts, [params] * len(prompts), use_tqdm=True)
        for question, out in zip(questions, outputs):
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
