"""The flags commands share: which model on which engine (`add_model_arguments`), which chat
template (`add_chat_template_argument`), how to sample (`add_sampling_arguments`), and their
checks, all run before the model loads (seconds).

A command that builds its engine from `engine_config(args)` honours every flag of
`add_model_arguments` (they are all `EngineConfig` fields); one that applies chat templates
reads `chat_template(args)`: the template text, or None for the model's own.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import re
import secrets
import sys
from pathlib import Path

from pagedattn.dtypes import KV_CACHE_DTYPE_NAMES
from pagedattn.engine.config import DTYPE_NAMES


class UsageError(ValueError):
    """A flag's value that cannot work; its message is the one line the user sees."""


def add_model_arguments(parser: argparse.ArgumentParser, *, max_num_seqs: int | None = None) -> None:
    """The model and engine flags; `--max-num-seqs` too (with that default) when `max_num_seqs`
    is given (a command that has its own leaves it out)."""
    group = parser.add_argument_group("model and engine")
    group.add_argument(
        "--model", default=None,
        help="a Hugging Face folder, a .gguf file or a Hub id org/name (default: the embedded SmolLM2-135M-Instruct)",
    )
    group.add_argument(
        "--tokenizer", default=None,
        help="take the tokenizer (and its chat template) from this folder, .gguf file or Hub id instead of --model's",
    )
    group.add_argument("--backend", default="auto", help="attention backend (see `pagedattn info`; default: auto)")
    group.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    group.add_argument("--dtype", default="auto", choices=[d for d in DTYPE_NAMES], help="model dtype")
    group.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPE_NAMES))
    group.add_argument("--max-model-len", type=int, default=None, help="cap the context (prompt + answer) in tokens")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="fix the KV pool's size in blocks")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=None,
        help="tokens one engine step computes; longer prompts are prefilled in chunks of this many "
             "(default: 2048 on the CPU, 8192 on CUDA)",
    )
    group.add_argument(
        "--gpu-memory-utilization", type=float, default=None,
        help="fraction of the GPU's memory for the model, activations and KV cache (default: 0.9; CUDA only)",
    )
    group.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs (CUDA only)")
    group.add_argument(
        "--no-cascade-attention", dest="cascade_attention", action="store_const", const=False, default=None,
        help="attend each request's whole context in every step, even where many share a long cached prefix "
             "(default: a shared prefix is attended once per step on CUDA)",
    )
    group.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1,
        help="shard the model over this many GPUs (processes: rank r on cuda:r; under torchrun, its ranks)",
    )
    if max_num_seqs is not None:
        group.add_argument("--max-num-seqs", type=int, default=max_num_seqs, help="sequences one engine step holds")


def add_chat_template_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chat-template", default=None, metavar="TEMPLATE",
        help="a Jinja chat template, inline or in a file, instead of the tokenizer's",
    )


def chat_template(args: argparse.Namespace) -> str | None:
    """The text of `--chat-template` (a file's content, or the flag's value as a template), its
    Jinja syntax checked; None without the flag."""
    value = args.chat_template
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        try:
            template = utf8(path.read_bytes(), f"--chat-template {value}")
        except OSError as e:
            raise UsageError(f"expected --chat-template to be a readable file or a template, got {value!r} ({e})"
                             ) from None
    elif any(c in value for c in "{}\n"):
        template = utf8(value, "--chat-template")
    else:
        raise UsageError(f"expected --chat-template to be a template file or an inline Jinja template, got {value!r} "
                         "(no such file)")
    try:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ModuleNotFoundError:  # the [hf] extra's; loading the model says how to install it
        return template
    try:  # transformers renders templates in this environment
        ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols]).parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise UsageError(f"expected a Jinja template in --chat-template, got a syntax error on line {e.lineno}: "
                         f"{e.message}") from None
    return template


def add_sampling_arguments(parser: argparse.ArgumentParser, *, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=-1, help="-1: every token")
    group.add_argument("--seed", type=int, default=None, help="makes sampling reproducible (default: a fresh seed)")
    group.add_argument(
        "--stop", action="append", default=None, metavar="TEXT", help="end the answer at TEXT (repeatable)"
    )
    group.add_argument("-n", type=int, default=1, dest="n", help="answers per prompt")


def sampling_params(args: argparse.Namespace):
    """The SamplingParams of the flags (a UsageError says which is wrong). Without --seed each
    run draws a fresh seed, so sampled answers vary between runs."""
    from pagedattn.engine.sampling_params import SamplingParams

    for i, stop in enumerate(args.stop or []):
        utf8(stop, f"--stop {i + 1}")
    seed = args.seed if args.seed is not None else secrets.randbits(63)
    try:
        return SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            max_tokens=args.max_tokens, seed=seed, stop=args.stop,
        )
    except ValueError as e:
        raise UsageError(_flag_names(str(e))) from None


def engine_config(args: argparse.Namespace):
    """The EngineConfig of the flags, checked against this machine: backend, device, dtypes,
    sizes and the model's and tokenizer's paths, all before anything is loaded. A command with
    its own `--max-num-seqs` has it checked here too."""
    from pagedattn.engine.config import EngineConfig

    knobs = {}
    if args.gpu_memory_utilization is not None:
        knobs["gpu_memory_utilization"] = args.gpu_memory_utilization
    if getattr(args, "max_num_seqs", None) is not None:
        knobs["max_num_seqs"] = args.max_num_seqs
    try:
        config = EngineConfig(
            model=args.model, tokenizer=args.tokenizer, backend=args.backend, device=args.device, dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
            num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
            tensor_parallel_size=args.tensor_parallel_size, cascade_attention=args.cascade_attention, **knobs,
        )
    except ValueError as e:
        message = _flag_names(str(e))
        if "--max-num-batched-tokens" in message:
            seqs = knobs.get("max_num_seqs", EngineConfig.max_num_seqs)
            message += f" (--max-num-seqs {seqs}: a step holds one token of each running sequence)"
        raise UsageError(message) from None
    if config.backend != "auto":
        from pagedattn.attention import get_backend

        get_backend(config.backend)  # BackendUnavailableError lists the names and the reasons
    for flag, value in (("--model", config.model), ("--tokenizer", config.tokenizer)):
        if value is None:
            continue
        path = Path(value).expanduser()
        if not path.exists() and (value.endswith(".gguf") or value.startswith((".", "/", "~"))):
            raise UsageError(f"expected {flag} to be an existing folder, .gguf file or a Hub id, got {value!r}")
    if args.gpu_memory_utilization is not None and config.resolved_device().type != "cuda":
        command = getattr(args, "command", None)
        print(f"pagedattn{' ' + command if command else ''}: warning: --gpu-memory-utilization has no effect on "
              "the CPU (its KV pool has a fixed budget; --num-kv-blocks sets it)", file=sys.stderr)
    return config


def load_llm(config):
    """The LLM of an `engine_config(args)`, loaded with the garbage collector paused: loading
    (transformers' import, the tokenizer, the model) makes a million long-lived objects, and the
    collections that their number triggers find no garbage among them (a second of a CPU start-up)."""
    from pagedattn.llm import LLM

    with _collector_paused():
        return LLM(
            config.model, tokenizer=config.tokenizer, backend=config.backend, device=config.device,
            dtype=config.dtype, kv_cache_dtype=config.kv_cache_dtype, max_model_len=config.max_model_len,
            num_kv_blocks=config.num_kv_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, enforce_eager=config.enforce_eager,
            gpu_memory_utilization=config.gpu_memory_utilization, tensor_parallel_size=config.tensor_parallel_size,
            cascade_attention=config.cascade_attention,
        )


@contextlib.contextmanager
def _collector_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def utf8(text: str | bytes, what: str) -> str:
    """`text` (bytes, or a str made from bytes with `surrogateescape`, as Python makes the command
    line and stdin) as a str that is valid UTF-8; else a UsageError naming `what` and the first
    bad byte."""
    if isinstance(text, bytes):
        try:
            return text.decode("utf-8")
        except UnicodeDecodeError as e:
            bad = f"the byte 0x{text[e.start]:02x} at byte {e.start}"
            raise UsageError(f"expected UTF-8 text in {what}, got {bad}") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: a byte that was not UTF-8
        code = ord(text[e.start])
        got = f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"the lone surrogate U+{code:04X}"
        raise UsageError(f"expected UTF-8 text in {what}, got {got} at byte {len(text[:e.start].encode())}") from None
    return text


def _flag_names(message: str) -> str:
    """An engine message ("expected 0 < top_p <= 1") in the flags' spelling ("expected 0 < --top-p <= 1")."""
    if message.startswith("expected n "):
        return "expected -n " + message[len("expected n "):]
    return _FLAG_NAME.sub(lambda m: "--" + m.group(0).replace("_", "-"), message, count=1)


_FLAG_NAME = re.compile(
    r"(?<![.\w-])(max_model_len|num_kv_blocks|block_size|kv_cache_dtype|max_tokens|temperature|top_p|top_k"
    r"|seed|stop|dtype|device|backend|max_num_batched_tokens|gpu_memory_utilization|max_num_seqs"
    r"|tensor_parallel_size)(?![\w])"
)
