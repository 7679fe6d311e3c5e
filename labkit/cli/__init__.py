"""The `labkit` command line: one sub-module per command, each with `register(subparsers)`.

Every command answers bad arguments with one line on stderr naming the argument and what would work, and
exit status 2 (`UsageError`), never a traceback. Heavy imports (torch, deepspeed) happen inside a command's
`run`, so `labkit budget --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import labkit

COMMANDS = (
    "doctor",
    "budget",
    "calibrate",
    "compare",
    "torchrun",
    "grade",
    "submit",
    "feedback",
    "slides",
    "release",
)  # modules of labkit.cli, in the order `labkit --help` lists them


class UsageError(Exception):
    """A bad argument or an impossible request: the message is one sentence that says what would work."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints a usage block by default)
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="labkit", description="A teaching lab for ZeRO-3: from scratch, FSDP2 and DeepSpeed."
    )
    # The DeepSpeed launcher runs `python -m labkit --local_rank=N COMMAND ...` (unless --no_local_rank);
    # LOCAL_RANK in the environment says the same, so the flag is accepted and ignored.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--version", action="version", version=f"labkit {labkit.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(f"labkit.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `labkit` console script; returns the exit status.

    A rank that torchrun or the DeepSpeed launcher started (a command that imported `labkit.cluster` under
    one) does not return: it leaves through `cluster.leave_launched_rank`, which skips the interpreter's
    teardown.
    """
    status = _run_command(argv)
    if "labkit.cluster" in sys.modules:
        from labkit import cluster

        if cluster.under_launcher():
            cluster.leave_launched_rank(status)
    return status


def _run_command(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except UsageError as e:
        print(str(e).strip().splitlines()[0], file=sys.stderr)
        return 2
    except ValueError as e:  # the library's own one-sentence errors for impossible requests
        print(f"labkit {args.command}: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("labkit: interrupted", file=sys.stderr)
        return 130
