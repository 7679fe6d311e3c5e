"""`labkit budget`: print what `labkit.budget.plan()` returns for one configuration, as a table or JSON.

Its flags, their defaults and help are made from `labkit.budget.PlanInputs`, so they are written once; a
value may carry its unit's size suffix (`70B`, `80GB`, `50GB/s`: `budget.parse_quantity`). `--world-size
auto` asks `budget.fewest_ranks` for the smallest world size that fits. Only the standard library and
`labkit.budget` are imported here: the command never waits for torch.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from labkit import budget, tables
from labkit.cli import UsageError
from labkit.fields import Spec
from labkit.names import HSDP, NVME, WEIGHTS_SHARDED

# The flags are made from labkit.budget.INPUTS: --NAME for each input (--no-NAME for a switch that is on by
# default), or the input's own `flag`. plan() names its arguments in Python; the user typed flags, so errors
# name the flag.
_FLAGS = {
    i.name: i.spec.flag
    or ("--no-" if i.spec.kind == "switch" and i.default else "--") + i.name.replace("_", "-")
    for i in budget.INPUTS
}
_FLAG_RE = re.compile(r"\b(" + "|".join(sorted(_FLAGS, key=len, reverse=True)) + r")\b")
AUTO = "auto"  # --world-size auto: the fewest ranks that fit


def _parser(spec: Spec, auto: bool = False):
    """The argparse type of one input: its text through `budget.parse_quantity`, a count kept whole."""

    def parse(text: str):
        if auto and text.strip().lower() == AUTO:
            return AUTO
        try:
            value = budget.parse_quantity(text, spec.unit)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        # a whole count as an int; a fractional one stays a float, which plan() then refuses by name
        return int(value) if spec.kind == "count" and value.is_integer() else value

    return parse


def _add_flag(parser: argparse.ArgumentParser, i: budget.Input) -> None:
    spec = i.spec
    unit = f" [{spec.unit}]" if spec.unit else ""
    if spec.kind == "switch":
        action = "store_false" if i.default else "store_true"
        help = f"switch off ({spec.help})" if i.default else spec.help
        parser.add_argument(_FLAGS[i.name], dest=i.name, action=action, help=help)
        return
    kwargs = {"required": True} if i.required else {"default": i.default}
    help = spec.help
    if spec.kind == "choice":
        kwargs["choices"] = spec.choices
        default = f" (default: {i.default})"
    else:
        auto = i.name == "world_size"
        kwargs["type"], kwargs["metavar"] = _parser(spec, auto), "N" if spec.kind == "count" else "X"
        if auto:
            help += f", or {AUTO}: the fewest that fit --gpu-memory (and --host-memory when offloading)"
        default = ""
        if not i.required and i.default is not None:
            shown = budget.format_bytes(i.default) if spec.unit == "bytes" else f"{i.default:g}"
            default = f" (default: {shown})"
    parser.add_argument(_FLAGS[i.name], dest=i.name, help=f"{help}{unit}{default}", **kwargs)


def _assumptions_epilog() -> str:
    """The step time's assumptions and their defaults, one a line, from the inputs marked `assumption`."""
    lines = ["the step time assumes (defaults; every plan prints the values it used):"]
    for i in budget.INPUTS:
        if i.spec.assumption:
            value = budget.format_count(i.default) if i.spec.unit == "params/s" else f"{i.default:g}"
            unit = "" if i.spec.unit == "fraction" else f" {i.spec.unit}"
            lines.append(f"  {_FLAGS[i.name]:<26} {value + unit:<15} {i.spec.help.split(';')[0]}")
    lines.append(
        "sizes take decimal suffixes: --params 70B, --gpu-memory 80GB, --link-gbytes 50GB/s (1 GB = 1e9 B)"
    )
    return "\n".join(lines)


def register(subparsers) -> None:
    """Add the `budget` command to the `labkit` parser."""
    p = subparsers.add_parser(
        "budget",
        help="memory, traffic and time per rank of one training step (closed form)",
        description="Closed-form memory per rank, traffic per rank per step and step time for data-parallel\n"
        "training (ddp, ZeRO-1/2/3, HSDP), and whether it fits the GPU and host memory.\n"
        "Bytes are decimal: 1 GB = 1e9 B.",
        epilog=_assumptions_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the epilog's one assumption a line
    )
    for i in budget.INPUTS:
        _add_flag(p, i)
    p.add_argument(
        "--machine",
        metavar="FILE",
        default=None,
        help="a machine profile of `labkit calibrate --out FILE`: its measured compute rate and collective "
        "costs price the step instead of --peak-tflops x --mfu and the links",
    )
    p.add_argument(
        "--json", metavar="OUT", default=None, help="write the result as JSON to OUT ('-': stdout)"
    )
    p.set_defaults(func=run)


def _flagged(message: str) -> str:
    """A library sentence with each argument name replaced by its flag, first line only."""
    return _FLAG_RE.sub(lambda m: _FLAGS[m.group(1)], str(message).strip().splitlines()[0])


def _plan(options: dict) -> dict:
    """plan() of the options, or with --world-size auto the plan at the fewest ranks that fit."""
    if options["world_size"] != AUTO:
        return budget.plan(**options)
    options = {k: v for k, v in options.items() if k != "world_size"}
    search = budget.fewest_ranks(**options)
    if search["world_size"] is None:
        raise UsageError(f"labkit budget: --world-size {AUTO}: {_flagged(search['reason'])}")
    result = search.pop("plan")
    result["fewest_ranks"] = search
    return result


# Inputs that only some plans read: (input, whether this plan reads it, what would make it read it). A value
# other than the default for a plan that does not read it is refused, as an ignored flag would mislead.
_READ_ONLY_WHEN = (
    ("group_size", lambda o: o["strategy"] == HSDP, "--strategy hsdp"),
    ("reshard_after_forward", lambda o: o["strategy"] in WEIGHTS_SHARDED, "--strategy zero3 or hsdp"),
    ("prefetch", lambda o: o["strategy"] in WEIGHTS_SHARDED, "--strategy zero3 or hsdp"),
    ("quant_block_elems", lambda o: o["qwz"] or o["qgz"], "--qwz or --qgz"),
    ("nvme_gbytes", lambda o: NVME in (o["offload_optimizer"], o["offload_params"]), "an offload to nvme"),
    (
        "host_gbytes",
        lambda o: (o["offload_optimizer"], o["offload_params"]) != ("none", "none"),
        "an offload",
    ),
    ("host_adam_params_per_s", lambda o: o["offload_optimizer"] != "none", "--offload-optimizer"),
    ("peak_tflops", lambda o: "machine" not in o, "no --machine (its profile's rate prices the compute)"),
    ("mfu", lambda o: "machine" not in o, "no --machine (its profile's rate prices the compute)"),
    *(
        (name, lambda o: o["hidden_size"] > 0, "--hidden-size (the activations' model)")
        for name in ("attention_heads", "seq_len", "micro_batch", "vocab_size")
    ),
    ("zero_init", lambda o: o["accounting"] == "deepspeed", "--accounting deepspeed"),
    ("additional_buffer_factor", lambda o: o["accounting"] == "deepspeed", "--accounting deepspeed"),
)


def _refuse_unread(options: dict) -> None:
    defaults = {i.name: i.default for i in budget.INPUTS}
    for name, reads, needs in _READ_ONLY_WHEN:
        if options[name] != defaults[name] and not reads(options):
            raise UsageError(
                f"labkit budget: {_FLAGS[name]} would change nothing in this plan: only a plan with {needs} "
                "reads it; drop it, or add what reads it"
            )


def run(args: argparse.Namespace) -> int:
    """Compute the plan, print the table (unless JSON goes to stdout), write JSON if asked."""
    try:
        machine = {} if args.machine is None else {"machine": budget.load_machine_profile(args.machine)}
        options = {i.name: getattr(args, i.name) for i in budget.INPUTS} | machine
        _refuse_unread(options)
        result = _plan(options)
    except ValueError as e:
        raise UsageError(f"labkit budget: {_flagged(e)}") from None
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
