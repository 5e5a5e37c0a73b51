"""`pagedattn generate`: answer prompts, streaming one answer or showing progress over many.

With an audio model (Whisper), `--audio FILE.wav` (repeatable) makes each file a request: its
PCM samples, averaged to mono and refused unless sampled at the model's rate (no resampling),
go through the model's feature extractor; a PROMPT, if given, is every file's decoder prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pagedattn.cli.model_args import (
    UsageError,
    add_chat_template_argument,
    add_model_arguments,
    add_sampling_arguments,
    chat_template,
    engine_config,
    load_llm,
    sampling_params,
    utf8,
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
    add_chat_template_argument(gen)
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout (JSON Lines)")
    gen.add_argument(
        "--audio", action="append", default=None, metavar="WAV",
        help="a PCM WAV file for an audio model (Whisper), one request each (repeatable); "
             "PROMPT, if given, is the decoder prompt",
    )
    add_sampling_arguments(gen, max_tokens=64)
    add_model_arguments(gen, max_num_seqs=256)
    gen.set_defaults(run=run)


def read_prompts(prompts: list[str], stdin=None) -> list[str]:
    """The prompts of the command line: `-` is stdin's text; no prompt at all is stdin's text
    when stdin is a pipe or file that is not empty, else DEFAULT_PROMPT. Text that is not UTF-8
    is a UsageError."""
    stdin = sys.stdin if stdin is None else stdin
    for i, p in enumerate(prompts):
        utf8(p, f"PROMPT {i + 1}")
    if "-" in prompts:
        if prompts.count("-") > 1:
            raise UsageError("expected `-` (the prompt from stdin) at most once, got it several times")
        text = read_stdin(stdin).strip()
        if not text:
            raise UsageError("expected a prompt on stdin for `-`, got nothing")
        return [text if p == "-" else p for p in prompts]
    if prompts:
        return prompts
    if stdin is not None and not stdin.isatty():
        text = read_stdin(stdin).strip()
        if text:
            return [text]
    return [DEFAULT_PROMPT]


def read_stdin(stdin) -> str:
    """All of stdin's text, refused (UsageError) unless it is UTF-8."""
    raw = getattr(stdin, "buffer", None)
    return utf8(raw.read() if raw is not None else stdin.read(), "stdin")


def run(args: argparse.Namespace) -> int:
    """Answer the prompts with the options above; the exit status is 1 when any request failed."""
    params = sampling_params(args)  # every check before the model loads
    config = engine_config(args)
    template = chat_template(args)
    if args.system is not None and args.no_chat_template:
        raise UsageError("expected --system without --no-chat-template (the system message needs the template)")
    if template is not None and args.no_chat_template:
        raise UsageError("expected --chat-template or --no-chat-template, got both")
    if args.system is not None:
        utf8(args.system, "--system")
    if args.audio:
        if args.system is not None or len(args.prompts) > 1:
            raise UsageError("expected at most one PROMPT (the decoder prompt) and no --system with --audio")
        audios = [read_wav(path) for path in args.audio]  # every file checked before the model loads
        questions = list(args.audio)
    else:
        questions = read_prompts(args.prompts)
    llm = load_llm(config)
    engine = llm.engine
    prompts = _audio_prompts(args, audios, llm) if args.audio else _text_prompts(args, questions, llm, template)
    start = time.perf_counter()
    if len(prompts) == 1 and params.n == 1 and not args.json:
        outputs = [stream(engine, prompts[0], params).output]
    else:
        outputs = llm.generate(prompts, params)  # a progress bar on a terminal, where it helps
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


def _text_prompts(args: argparse.Namespace, questions: list[str], llm, template: str | None) -> list:
    """The engine prompts of text questions: through the chat template (`template`, else the
    model's) when there is one."""
    model = args.model or "the default model"
    if llm.engine.input_processor.audio is not None:
        raise UsageError(f"expected --audio FILE.wav for the audio model {model!r}, got text prompts")
    use_template = not args.no_chat_template and (template is not None or llm.engine.spec.has_chat_template)
    if args.system is not None and not use_template:
        raise UsageError(f"expected a model with a chat template (or --chat-template) for --system, got {model!r} "
                         "without one")
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    return [chat_prompt(llm.tokenizer, [*system, {"role": "user", "content": q}], template) if use_template else q
            for q in questions]


def _audio_prompts(args: argparse.Namespace, audios: list, llm) -> list[dict]:
    """The engine prompts of `--audio` files ((samples, rate) each), refused unless the model
    takes audio at their sampling rate."""
    model = args.model or "the default model"
    audio_input = llm.engine.input_processor.audio  # the model's LogMelInput, None when it takes no audio
    if audio_input is None:
        raise UsageError(f"expected a model with an audio encoder (Whisper) for --audio, got {model!r}")
    if audio_input.sampling_rate is None:
        raise UsageError(
            f"expected a preprocessor_config.json (the feature extractor) for --audio in {model!r}, found none"
        )
    for path, (_, rate) in zip(args.audio, audios):
        if rate != audio_input.sampling_rate:
            raise UsageError(
                f"expected --audio sampled at {audio_input.sampling_rate} Hz (no resampling), got {rate} Hz in {path!r}"
            )
    decoder = {"decoder_prompt": args.prompts[0]} if args.prompts else {}
    return [{"encoder_prompt": {"audio": audio}, **decoder} for audio in audios]


def read_wav(path: str):
    """(float32 samples in [-1, 1] [samples], sampling rate in Hz) of a PCM WAV file of 8, 16 or
    32 bits, its channels averaged to mono; a UsageError says why a file cannot be read."""
    import wave

    import numpy as np

    try:
        with wave.open(path, "rb") as f:
            width, channels, rate = f.getsampwidth(), f.getnchannels(), f.getframerate()
            raw = f.readframes(f.getnframes())
    except (OSError, EOFError, wave.Error) as e:
        raise UsageError(f"expected --audio to name a PCM WAV file, got {path!r} ({e})") from None
    if width == 1:  # 8-bit WAV samples are unsigned
        samples = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128) / 128
    elif width in (2, 4):
        samples = np.frombuffer(raw, f"<i{width}").astype(np.float32) / 2 ** (8 * width - 1)
    else:
        raise UsageError(f"expected 8-, 16- or 32-bit PCM samples in {path!r}, got {8 * width}-bit ones")
    return samples.reshape(-1, channels).mean(axis=1), rate


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
