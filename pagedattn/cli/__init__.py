"""The command line: `pagedattn info`, `pagedattn generate`, `pagedattn bench`.

Each command is a module here with `add_parser(subparsers)` (its arguments) and `run(args) -> int`
(the exit status); `main` parses and dispatches. `python -m pagedattn` and the `pagedattn`
console script both call `main`.
"""

from __future__ import annotations

import argparse

from pagedattn.cli import bench, generate, info

COMMANDS = (info, generate, bench)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedattn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return args.run(args)


__all__ = ["main"]
