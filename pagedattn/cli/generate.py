"""`pagedattn generate`: answer prompts, streaming one answer or showing progress over many."""

from __future__ import annotations

import argparse
import json
import sys
import time

from pagedattn.cli.model_args import (
    UsageError,
    add_model_arguments,
    add_sampling_arguments,
    engine_config,
    load_llm,
    sampling_params,
)
from pagedattn.cli.streaming import chat_prompt, stream

DEFAULT_PROMPT = "What is the capital of France?"


def add_parser(sub) -> None:
    """Register `generate` on `sub`, the `add_subparsers()` object of the `pagedattn` parser."""
    gen = sub.add_parser(
        "generate", help="answer prompts with a model (the embedded default when none is given)",
        description="Answer each PROMPT; `-`, or no PROMPT with a pipe on stdin, reads the prompt from stdin.",
    )
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help=f"default: {DEFAULT_PROMPT!r}")
    gen.add_argument("--system", default=None, help="a system message (through the chat template)")
    gen.add_argument("--no-chat-template", action="store_true", help="send the prompts as they are")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout (JSON Lines)")
    add_sampling_arguments(gen, max_tokens=64)
    add_model_arguments(gen)
    gen.set_defaults(run=run)


def read_prompts(prompts: list[str], stdin=None) -> list[str]:
    """The prompts of the command line: `-` is stdin's text; no prompt at all is stdin's text
    when stdin is a pipe or file that is not empty, else DEFAULT_PROMPT."""
    stdin = sys.stdin if stdin is None else stdin
    if "-" in prompts:
        if prompts.count("-") > 1:
            raise UsageError("expected `-` (the prompt from stdin) at most once, got it several times")
        text = stdin.read().strip()
        if not text:
            raise UsageError("expected a prompt on stdin for `-`, got nothing")
        return [text if p == "-" else p for p in prompts]
    if prompts:
        return prompts
    if stdin is not None and not stdin.isatty():
        text = stdin.read().strip()
        if text:
            return [text]
    return [DEFAULT_PROMPT]


def run(args: argparse.Namespace) -> int:
    """Answer the prompts with the options above; the exit status is 1 when any request failed."""
    params = sampling_params(args)  # every check before the model loads
    config = engine_config(args)
    if args.system is not None and args.no_chat_template:
        raise UsageError("expected --system without --no-chat-template (the system message needs the template)")
    questions = read_prompts(args.prompts)
    llm = load_llm(config)
    engine = llm.engine
    use_template = not args.no_chat_template and engine.spec.has_chat_template
    if args.system is not None and not use_template:
        model = args.model or "the default model"
        raise UsageError(f"expected a model with a chat template for --system, got {model!r} without one")
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    prompts = [chat_prompt(llm.tokenizer, [*system, {"role": "user", "content": q}]) if use_template else q
               for q in questions]
    start = time.perf_counter()
    if len(prompts) == 1 and params.n == 1 and not args.json:
        outputs = [stream(engine, prompts[0], params)]
    else:
        outputs = engine.generate(prompts, [params] * len(prompts), use_tqdm=len(prompts) > 1 and sys.stderr.isatty())
        for question, out in zip(questions, outputs):
            if args.json:
                print(json.dumps(_as_json(question, out)), flush=True)
            elif out.error is None:
                for k, c in enumerate(out.outputs):
                    label = f" [{k + 1}/{len(out.outputs)}]" if len(out.outputs) > 1 else ""
                    print(f"### {question}{label}\n{c.text}\n", flush=True)
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    failed = [(i, o) for i, o in enumerate(outputs) if o.error is not None]
    for i, o in failed:
        name = f"prompt {i + 1} of {len(outputs)} ({_short(questions[i])})" if len(outputs) > 1 else "the prompt"
        print(f"pagedattn generate: error: {name}: {o.error}", file=sys.stderr)
    print(f"[{tokens} tokens in {elapsed:.2f} s: {tokens / max(elapsed, 1e-9):.1f} tokens/s]", file=sys.stderr)
    return 1 if failed else 0


def _short(text: str, width: int = 40) -> str:
    return repr(text if len(text) <= width else text[: width - 3] + "...")


def _as_json(question: str, out) -> dict:
    return {
        "prompt": question,
        "prompt_tokens": len(out.prompt_token_ids),
        "outputs": [
            {"text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
             "cumulative_logprob": c.cumulative_logprob}
            for c in out.outputs
        ],
        "error": out.error,
    }
