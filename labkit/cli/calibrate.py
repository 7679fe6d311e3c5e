"""`labkit calibrate --out machine.json`: measure this machine for `labkit.budget`'s time model.

The work is `labkit.calibrate.calibrate` (compute rate, core share per world size, gloo's latency and
bandwidth per collective kind and world size); this file parses the flags, prints the fits and writes the
profile that `labkit budget --machine` and `labkit compare --machine` read.
"""

from __future__ import annotations

import argparse
import json
import os

from labkit.cli import UsageError
from labkit.cli.paths import writable_file


def _world_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: pass world sizes separated by commas, e.g. 2,4"
        ) from None
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: pass world sizes of 2 ranks or more, e.g. 2,4")
    return sizes


def _repeats(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: pass a whole number of rounds, 1 or more")
    return int(text)


def register(subparsers) -> None:
    """Add the `calibrate` command to the `labkit` parser."""
    p = subparsers.add_parser(
        "calibrate",
        help="measure this machine's compute rate and collective costs for labkit budget's time model",
        description="Measure, in about a minute, this machine's compute rate for the lab's model (one rank, "
        "one thread), the share of it each rank keeps when ranks share the cores, how far the ranks drift apart "
        "between two waits on each other, and gloo's latency and bandwidth per collective and world size; write them as a machine profile (JSON). The compute figures "
        "are medians over interleaved rounds, so a passing load moves them less.",
    )
    p.add_argument("--out", metavar="FILE", required=True, help="where to write the profile (JSON)")
    p.add_argument("--model", default="small", help="the lab's model to time (labkit.model.CONFIGS)")
    p.add_argument("--world-sizes", type=_world_sizes, default=(2, 4), help="ranks to measure at, e.g. 2,4")
    p.add_argument(
        "--repeats",
        type=_repeats,
        default=None,
        help="interleaved rounds of the compute measurements, whose medians are kept (default 3)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from labkit import calibrate
    from labkit.cluster import rank_limit
    from labkit.model import CONFIGS

    if args.model not in CONFIGS:
        raise UsageError(
            f"labkit calibrate: --model {args.model!r} is unknown; choose from {', '.join(CONFIGS)}"
        )
    global_batch = CONFIGS[args.model].global_batch
    for n in args.world_sizes:
        limit, why = rank_limit()
        if n > limit:
            raise UsageError(f"labkit calibrate: --world-sizes {n} but {why}; pass sizes <= {limit}")
        if global_batch % n:
            raise UsageError(
                f"labkit calibrate: --world-sizes {n} does not divide the global batch of "
                f"{global_batch} sequences of {args.model!r}; pass divisors of it"
            )
    # checked, not opened: a profile already there stays whole until the new one is measured
    writable_file("calibrate", "--out", args.out)
    repeats = calibrate.REPEATS if args.repeats is None else args.repeats
    profile = calibrate.calibrate(args.model, args.world_sizes, repeats=repeats)
    print(calibrate.profile_table(profile))
    partial = f"{args.out}.partial"
    with open(partial, "w") as f:
        json.dump(profile, f, indent=1)
    os.replace(partial, args.out)  # whole or not at all
    return 0
