"""The command line: `pagedattn info`, `pagedattn generate`, `pagedattn bench`."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

DEFAULT_PROMPT = "What is the capital of France?"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def info(_args: argparse.Namespace) -> int:
    """Devices, versions, and every backend with its availability and reasons."""
    import torch

    import pagedattn

    print(f"pagedattn {pagedattn.__version__}")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {_version('triton')}, "
          f"flashinfer {_version('flashinfer-python')}, xformers {_version('xformers')}, "
          f"transformers {_version('transformers')}")
    print("devices:")
    print("  cpu")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"  cuda:{i} {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")
    else:
        print("  (no CUDA device)")
    print("backends:")
    for status in pagedattn.list_backends():
        if status.available:
            via = f" (via {status.provider})" if status.provider and status.provider != status.name else ""
            print(f"  {status.name:<11} available{via}")
        else:
            print(f"  {status.name:<11} unavailable: {'; '.join(status.reasons)}")
    try:
        auto = pagedattn.get_backend("auto").get_name()
    except pagedattn.BackendUnavailableError as e:
        auto = f"none ({e})"
    print(f"auto -> {auto}")
    return 0


def generate(args: argparse.Namespace) -> int:
    from pagedattn.engine.cli_generate import generate_main

    return generate_main(args)


def bench(args: argparse.Namespace) -> int:
    from pagedattn.benchmarks import bench_main

    return bench_main(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="devices, versions and backends").set_defaults(func=info)

    gen = sub.add_parser("generate", help="answer prompts with a model (the embedded default when none is given)")
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help=f"default: {DEFAULT_PROMPT!r}")
    gen.add_argument("--model", default=None, help="a Hugging Face folder or a .gguf file (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--backend", default="auto")
    gen.add_argument("--device", default="auto")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--no-chat-template", action="store_true", help="send the prompts as they are")
    gen.set_defaults(func=generate)

    b = sub.add_parser("bench", help="benchmarks (kernels against peers, backends against each other, "
                                     "engine against transformers)")
    b.add_argument("what", choices=["kernels", "backends", "engine"])
    b.add_argument("--out", default=None, help="write the results here (markdown for kernels/backends, JSON for engine)")
    b.add_argument("--device", default="cpu", help="engine benchmark device (cpu or cuda)")
    b.set_defaults(func=bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "generate" and not args.prompts:
        args.prompts = [DEFAULT_PROMPT]
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
