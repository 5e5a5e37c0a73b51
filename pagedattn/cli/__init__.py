"""The command line: `pagedattn info`, `generate`, `chat`, `bench`, `serve`.

Each command is a module here with `add_parser(subparsers)` (its arguments) and `run(args) -> int`
(the exit status); `main` parses and dispatches. `python -m pagedattn` and the `pagedattn`
console script both call `main`. A new command (e.g. `serve`) is one more module in `COMMANDS`;
`model_args` holds the model and sampling flags commands share.

Exit statuses: 0 success, 1 a request failed or an unexpected error, 2 a user error (a bad flag
or value, a model that cannot be found or loaded, a missing extra), 130 interrupted. An error is
one line on stderr; `--verbose` (before or after the command) adds the traceback.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

from pagedattn.attention import BackendUnavailableError
from pagedattn.cli import bench, chat, generate, info
from pagedattn.cli.model_args import UsageError
from pagedattn.serve import command as serve

COMMANDS = (info, generate, chat, bench, serve)

USER_ERRORS = (UsageError, BackendUnavailableError, ValueError, LookupError, OSError, ImportError)
"""Exceptions that mean the user asked for something impossible: a one-line message, exit 2.
(UnsupportedModelError, MissingExtraError and FileNotFoundError are among them.)"""


class _Parser(argparse.ArgumentParser):
    """argparse, whose mistakes print one line (and a pointer to --help) instead of the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _parser() -> argparse.ArgumentParser:
    import pagedattn

    parser = _Parser(prog="pagedattn", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"pagedattn {pagedattn.__version__}")
    parser.add_argument("--verbose", action="store_true", help="show tracebacks and the engine's log")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    verbose = "--verbose" in argv  # wherever it stands, so that errors of any stage obey it
    args = _parser().parse_args([a for a in argv if a != "--verbose"])
    if verbose:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader went away (`pagedattn generate ... | head`): stop quietly; point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if verbose:
            raise
        status = 2 if isinstance(e, USER_ERRORS) else 1
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = "" if status == 2 else f" ({type(e).__name__}; run with --verbose for the traceback)"
        print(f"pagedattn {args.command}: error: {message}{hint}", file=sys.stderr)
        return status


def entry_point() -> None:
    """The `pagedattn` executable (and `python -m pagedattn`): `main`, then exit with its status.
    What is left at exit (torch's objects, a model's) is first frozen out of the garbage
    collector: the interpreter's final collections over it took about a second of every run."""
    status = main()
    gc.freeze()
    sys.exit(status)


__all__ = ["COMMANDS", "entry_point", "main"]
