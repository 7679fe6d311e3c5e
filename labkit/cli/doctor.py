"""`labkit doctor [--json PATH|-] [--skip-smoke] [--class N]`: is this machine ready for the lab? (labkit.doctor)"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from labkit.cli.paths import writable_file


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check versions, devices, limits, backend, DeepSpeed ops, the Jupyter kernel and server; run a 2-rank "
        "all_reduce",
        description="Check that this machine is ready for the lab. The Jupyter server checked is the one this "
        "command runs under (run it in a JupyterLab terminal, or as !labkit doctor in a notebook, on a hub), else "
        "the jupyter-lab on PATH. Exit status 1, with one line of advice per problem, when something is missing.",
    )
    p.add_argument(
        "--json", metavar="PATH", help="also write the report as JSON to PATH ('-' for stdout only)"
    )
    p.add_argument("--skip-smoke", action="store_true", help="do not run the 2-rank all_reduce smoke test")
    p.add_argument(
        "--class",
        dest="students",
        metavar="N",
        type=int,
        default=None,
        help="N students share this node: how many ranks each may use, which notebooks' defaults fit "
        "(cores and memory), with one line of advice per notebook that does not, and where each notebook's "
        "ranks run (GPUs or CPU ranks) with the GPUs per student server that would put them on GPUs",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from labkit.cli import UsageError

    if args.students is not None and args.students < 1:
        raise UsageError(f"labkit doctor: --class must be 1 or more students; got {args.students}")
    from labkit.doctor import diagnose, format_report

    to_stdout = args.json == "-"
    if args.json and not to_stdout:
        writable_file("doctor", "--json", args.json)
    # With --json -, stdout carries the JSON alone: anything the ranks print goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if to_stdout else contextlib.nullcontext():
        report = diagnose(smoke=not args.skip_smoke, students=args.students)
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
