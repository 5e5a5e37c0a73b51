"""`pagedattn serve`: arguments, checked before the model loads, then uvicorn over `build_app`."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")


def add_parser(sub) -> None:
    """Register `serve` on `sub`, the `add_subparsers()` object of the `pagedattn` parser."""
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    p.add_argument("--model", default=None,
                   help="a Hugging Face folder or a .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="the name clients send as 'model' (default: from --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("PAGEDATTN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDATTN_API_KEY, else none)")
    p.add_argument("--max-concurrent", type=int, default=64, help="requests in flight; more are answered 429")
    p.add_argument("--max-prompt-len", type=int, default=None, help="longest prompt in tokens (default: the context)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="largest max_tokens a request may ask (default: the context)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per engine step")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool size in blocks (default: sized from memory)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(run=run)


def _check(args: argparse.Namespace) -> str | None:
    """The first user error in `args`, or None."""
    missing = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return f"serve needs {', '.join(missing)}: pip install 'pagedattn[serve]'"
    if not 0 <= args.port <= 65535:
        return f"expected --port in [0, 65535], got {args.port}"
    for name in ("max_concurrent", "max_prompt_len", "max_tokens", "max_num_seqs", "num_kv_blocks"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"expected --{name.replace('_', '-')} >= 1, got {value}"
    if args.model is not None and not os.path.exists(args.model):
        return f"expected --model to be a folder or a .gguf file, got {args.model!r} which does not exist"
    return None


def run(args: argparse.Namespace) -> int:
    error = _check(args)
    if error is not None:
        print(f"pagedattn serve: error: {error}", file=sys.stderr)
        return 2
    import uvicorn

    from pagedattn.attention.registry import BackendUnavailableError
    from pagedattn.engine.config import EngineConfig
    from pagedattn.engine.llm_engine import LLMEngine
    from pagedattn.serve.app import ServeLimits, build_app
    from pagedattn.serve.async_engine import AsyncEngine
    from pagedattn.serve.metrics import ServerMetrics

    try:
        config = EngineConfig(model=args.model, backend=args.backend, device=args.device, dtype=args.dtype,
                              max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks)
        engine = LLMEngine(config)
    except (ValueError, BackendUnavailableError) as e:  # a bad value the engine names
        print(f"pagedattn serve: error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or (
        os.path.basename(os.path.normpath(args.model)) if args.model else "SmolLM2-135M-Instruct"
    )
    limits = ServeLimits(
        max_concurrent=args.max_concurrent, max_prompt_len=args.max_prompt_len, max_tokens=args.max_tokens
    )
    app = build_app(AsyncEngine(engine, ServerMetrics(name)), name, api_key=args.api_key, limits=limits)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
