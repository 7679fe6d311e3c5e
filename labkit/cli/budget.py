"""`labkit budget`: print what `labkit.budget.plan()` returns for one configuration, as a table or JSON.

Its flags, their defaults and help are made from `labkit.budget.PlanInputs`, so they are written once. Only
the standard library and `labkit.budget` are imported here: the command never waits for torch.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from labkit import budget, tables
from labkit.cli import UsageError

# The flags are made from labkit.budget.INPUTS: --NAME for each input (--no-NAME for a switch that is on by
# default). plan() names its arguments in Python; the user typed flags, so errors name the flag.
_FLAGS = {
    i.name: ("--no-" if i.spec.kind == "switch" and i.default else "--") + i.name.replace("_", "-")
    for i in budget.INPUTS
}
_FLAG_RE = re.compile(r"\b(" + "|".join(sorted(_FLAGS, key=len, reverse=True)) + r")\b")


def number(text: str) -> int | float:
    """A count as typed (`256`, `30e9`): an int when whole, else the float, which plan() then refuses.

    (argparse names this function when the text is no number: "invalid number value: 'lots'".)
    """
    value = float(text)
    return int(value) if value.is_integer() else value


def _add_flag(parser: argparse.ArgumentParser, i: budget.Input) -> None:
    spec = i.spec
    unit = f" [{spec.unit}]" if spec.unit else ""
    if spec.kind == "switch":
        action = "store_false" if i.default else "store_true"
        help = f"switch off ({spec.help})" if i.default else spec.help
        parser.add_argument(_FLAGS[i.name], dest=i.name, action=action, help=help)
        return
    kwargs = {"required": True} if i.required else {"default": i.default}
    if spec.kind == "choice":
        kwargs["choices"] = spec.choices
        default = f" (default: {i.default})"
    else:
        kwargs["type"], kwargs["metavar"] = (number, "N") if spec.kind == "count" else (float, "X")
        default = "" if i.required or i.default is None else f" (default: {i.default:g})"
    parser.add_argument(_FLAGS[i.name], help=f"{spec.help}{unit}{default}", **kwargs)


def register(subparsers) -> None:
    """Add the `budget` command to the `labkit` parser."""
    p = subparsers.add_parser(
        "budget",
        help="memory, traffic and time per rank of one training step (closed form)",
        description="Closed-form memory per rank, traffic per rank per step and step time for data-parallel "
        "training (ddp, ZeRO-1/2/3, HSDP). Bytes are decimal: 1 GB = 1e9 B.",
    )
    for i in budget.INPUTS:
        _add_flag(p, i)
    p.add_argument(
        "--json", metavar="OUT", default=None, help="write the result as JSON to OUT ('-': stdout)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Compute the plan, print the table (unless JSON goes to stdout), write JSON if asked."""
    try:
        result = budget.plan(**{i.name: getattr(args, i.name) for i in budget.INPUTS})
    except ValueError as e:
        message = _FLAG_RE.sub(lambda m: _FLAGS[m.group(1)], str(e).strip().splitlines()[0])
        raise UsageError(f"labkit budget: {message}") from None
    text = json.dumps(result, indent=2)
    if args.json == "-":
        sys.stdout.write(text + "\n")
        return 0
    print(tables.plan_table(result))
    if args.json:
        try:
            with open(args.json, "w") as f:
                f.write(text + "\n")
        except OSError as e:
            raise UsageError(
                f"labkit budget: --json {args.json}: cannot write ({e.strerror}); pass a writable path or '-'."
            ) from None
    return 0
