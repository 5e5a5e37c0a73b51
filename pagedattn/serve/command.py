"""`pagedattn serve`: arguments checked and the port bound before the model loads, then uvicorn
over `build_app`.

The model and engine flags are `pagedattn.cli.model_args`'s, shared with `generate` and `chat`;
user errors raise `UsageError` (or `MissingExtraError`), which `pagedattn.cli.main` prints as
one line with exit status 2. A port in use is such an error, found in a second, not after the
model has loaded: the socket is bound first (as vLLM does) and handed to uvicorn.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import socket
import sys

from pagedattn.cli.model_args import (
    UsageError,
    add_chat_template_argument,
    add_model_arguments,
    chat_template,
    engine_config,
)
from pagedattn.serve import MAX_WAITING

SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")
"""The modules of the `[serve]` extra."""



def add_parser(sub) -> None:
    """Register `serve` on `sub`, the `add_subparsers()` object of the `pagedattn` parser."""
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_model_arguments(p)
    add_chat_template_argument(p)
    group = p.add_argument_group("server")
    group.add_argument("--served-model-name", default=None, help="the 'model' clients send (default: from --model)")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDATTN_API_KEY, else none)")
    group.add_argument("--max-waiting", type=int, default=MAX_WAITING,
                       help="requests that may wait for the running batch; more are answered 429 with Retry-After "
                            f"(default: {MAX_WAITING})")
    group.add_argument("--max-prompt-len", type=int, default=None, help="longest prompt in tokens (default: the context)")
    group.add_argument("--max-tokens", type=int, default=None,
                       help="largest max_tokens a request may ask (default: the context)")
    group.add_argument("--max-num-seqs", type=int, default=64, help="sequences per engine step")
    group.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(run=run)


def _check(args: argparse.Namespace) -> None:
    """Raise UsageError for the first impossible server flag (the model's are `engine_config`'s)."""
    from pagedattn.models.loader import MissingExtraError

    missing = [m for m in SERVE_MODULES if m not in sys.modules and importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(
            f"serve needs the [serve] extra (missing: {', '.join(missing)}); "
            "install it with `pip install 'pagedattn[serve]'`"
        )
    if not 0 <= args.port <= 65535:
        raise UsageError(f"expected --port in [0, 65535], got {args.port}")
    for name in ("max_waiting", "max_prompt_len", "max_tokens", "max_num_seqs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"expected --{name.replace('_', '-')} >= 1, got {value}")


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not listening yet: connections are refused until the
    server starts). A UsageError when the address cannot be had (in use, not local, unknown)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UsageError(f"expected --host to be an address of this machine, got {host!r} ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a just-stopped server's port is free again
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UsageError(f"expected a free port, got {host}:{port} which cannot be bound ({e.strerror})") from None
    sock.set_inheritable(True)
    return sock


def _log_to_stderr(level: str) -> None:
    """Show the server's own lines (the throughput log, ignored fields) beside uvicorn's."""
    logger = logging.getLogger("pagedattn")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())


def run(args: argparse.Namespace) -> int:
    _check(args)
    template = chat_template(args)  # checked before the model loads
    config = engine_config(args)
    try:
        config = dataclasses.replace(config, max_num_seqs=args.max_num_seqs)
    except ValueError as e:
        raise UsageError(str(e).replace("max_num_seqs", "--max-num-seqs")) from None
    sock = bind(args.host, args.port)
    try:
        import uvicorn

        from pagedattn.engine.llm_engine import LLMEngine
        from pagedattn.serve.app import build_app
        from pagedattn.serve.async_engine import AsyncEngine
        from pagedattn.serve.metrics import ServerMetrics
        from pagedattn.serve.serving import ServeLimits

        _log_to_stderr(args.log_level)
        engine = LLMEngine(config)
        name = args.served_model_name or (
            os.path.basename(os.path.normpath(args.model)) if args.model else "SmolLM2-135M-Instruct"
        )
        limits = ServeLimits(max_waiting=args.max_waiting, max_prompt_len=args.max_prompt_len,
                             max_tokens=args.max_tokens)
        api_key = args.api_key if args.api_key is not None else os.environ.get("PAGEDATTN_API_KEY")
        app = build_app(AsyncEngine(engine, ServerMetrics(name)), name, api_key=api_key, limits=limits,
                        chat_template=template)
        server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level))
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it stopped on; a clean stop (as uvicorn.run)
            pass
        finally:
            engine.shutdown()  # tensor-parallel workers end with the server
    finally:
        sock.close()
    return 0
