"""`labkit doctor [--json PATH|-] [--skip-smoke]`: is this machine ready for the lab? (see labkit.doctor)"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check versions, devices, backend, DeepSpeed ops, the Jupyter kernel; run a 2-rank all_reduce",
        description="Check that this machine is ready for the lab. Exit status 1, with one line of advice "
        "per problem, when something is missing.",
    )
    p.add_argument(
        "--json", metavar="PATH", help="also write the report as JSON to PATH ('-' for stdout only)"
    )
    p.add_argument("--skip-smoke", action="store_true", help="do not run the 2-rank all_reduce smoke test")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from labkit.doctor import diagnose, format_report

    to_stdout = args.json == "-"
    # With --json -, stdout carries the JSON alone: anything the ranks print goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if to_stdout else contextlib.nullcontext():
        report = diagnose(smoke=not args.skip_smoke)
    text = json.dumps(report, indent=2)
    if to_stdout:
        print(text)
        for problem in report["problems"]:
            print(f"labkit doctor: {problem}", file=sys.stderr)
    else:
        print(format_report(report))
        if args.json:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0 if report["ok"] else 1
