"""The flags commands share: which model on which engine (`add_model_arguments`), how to sample
(`add_sampling_arguments`), and their checks, all run before the model loads (seconds)."""

from __future__ import annotations

import argparse
import re
import secrets
from pathlib import Path

from pagedattn.dtypes import KV_CACHE_DTYPE_NAMES
from pagedattn.engine.config import DTYPE_NAMES


class UsageError(ValueError):
    """A flag's value that cannot work; its message is the one line the user sees."""


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and engine")
    group.add_argument(
        "--model", default=None,
        help="a Hugging Face folder, a .gguf file or a Hub id org/name (default: the embedded SmolLM2-135M-Instruct)",
    )
    group.add_argument("--backend", default="auto", help="attention backend (see `pagedattn info`; default: auto)")
    group.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    group.add_argument("--dtype", default="auto", choices=[d for d in DTYPE_NAMES], help="model dtype")
    group.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPE_NAMES))
    group.add_argument("--max-model-len", type=int, default=None, help="cap the context (prompt + answer) in tokens")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="fix the KV pool's size in blocks")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")


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
    sizes and the model's path, all before anything is loaded."""
    from pagedattn.engine.config import EngineConfig

    try:
        config = EngineConfig(
            model=args.model, backend=args.backend, device=args.device, dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
            num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
        )
    except ValueError as e:
        raise UsageError(_flag_names(str(e))) from None
    if config.backend != "auto":
        from pagedattn.attention import get_backend

        get_backend(config.backend)  # BackendUnavailableError lists the names and the reasons
    if config.model is not None:
        path = Path(config.model).expanduser()
        if not path.exists() and (config.model.endswith(".gguf") or config.model.startswith((".", "/", "~"))):
            raise UsageError(f"expected --model to be an existing folder, .gguf file or a Hub id, got {config.model!r}")
    return config


def load_llm(config):
    """The LLM of an `engine_config(args)`."""
    from pagedattn.llm import LLM

    return LLM(
        config.model, backend=config.backend, device=config.device, dtype=config.dtype,
        kv_cache_dtype=config.kv_cache_dtype, max_model_len=config.max_model_len,
        num_kv_blocks=config.num_kv_blocks, block_size=config.block_size,
    )


def _flag_names(message: str) -> str:
    """An engine message ("expected 0 < top_p <= 1") in the flags' spelling ("expected 0 < --top-p <= 1")."""
    if message.startswith("expected n "):
        return "expected -n " + message[len("expected n "):]
    return _FLAG_NAME.sub(lambda m: "--" + m.group(0).replace("_", "-"), message, count=1)


_FLAG_NAME = re.compile(
    r"(?<![.\w-])(max_model_len|num_kv_blocks|block_size|kv_cache_dtype|max_tokens|temperature|top_p|top_k"
    r"|seed|stop|dtype|device|backend)(?![\w])"
)
