"""`labkit compare`: train several engines on the same model, seed and batches; print a table, write JSON.

The work is `labkit.engines.loop.compare`; this file parses flags, checks them (errors name the flag),
prints one progress line per engine on stderr as it finishes, and the table on stdout
(`labkit.tables.compare_table`).

Under torchrun or the DeepSpeed launcher (`labkit.cluster.under_launcher`) every rank runs this command:
the ranks already exist, so `--world-size` defaults to the launcher's WORLD_SIZE (and must equal it), the
engines run in place, and only global rank 0 prints and writes `--json`. docs/cluster.md has the recipes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import replace

from labkit.cli import UsageError
from labkit.cli.paths import writable_file, writable_folder
from labkit.engines import ENGINES, validation
from labkit.engines.registry import DDP, ORACLE
from labkit.engines.run_config import DEFAULTS, SETTINGS, RunConfig
from labkit.fields import Spec


def _engine_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"pass engine names separated by commas, from {','.join(ENGINES)}")
    for name in names:
        if name not in ENGINES:
            raise argparse.ArgumentTypeError(f"unknown engine {name!r}; choose from {','.join(ENGINES)}")
    return names


def _positive(convert: Callable[[str], float], what: str, hint: str) -> Callable[[str], float]:
    """An argparse type: `convert(text)` above 0, or an error that says `what` it must be and `hint`."""

    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}; pass {hint}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} is not allowed; pass {hint}")
        return value

    return parse


_positive_int = _positive(int, "a whole number", "1 or more")
_positive_float = _positive(float, "a number", "a value above 0, e.g. 1.0")
# The flags that take a value, by setting: a `RunConfig` sentence names `setting=value`, the user typed these.
_VALUE_FLAGS = {name: s.flag for name, s in SETTINGS.items() if s.flag and s.kind != "switch"}


def _flag_type(setting: Spec) -> Callable[[str], object] | None:
    """The argparse type of a setting's flag: a count of 1 or more and a rate checked as argparse errors; a
    model's name stays text (`RunConfig` checks it) and a choice is argparse's `choices`."""
    if setting.kind == "count":
        return _positive_int if setting.low == 1 else int
    return _positive_float if setting.kind == "rate" else None


def _add_setting_flag(parser: argparse.ArgumentParser, name: str, setting: Spec) -> None:
    """The flag of one `RunConfig` setting: its default, choices and help from the schema.

    A switch's flag turns it off; `--world-size` defaults to None (2, or the launcher's WORLD_SIZE: `run`).
    """
    if setting.kind == "switch":
        help = setting.flag_help or setting.help
        parser.add_argument(setting.flag, dest=name, action="store_false", default=DEFAULTS[name], help=help)
        return
    kwargs = {"choices": setting.choices} if setting.choices else {"type": _flag_type(setting)}
    default, help = DEFAULTS[name], setting.help
    if name == "world_size":
        default, help = None, f"{help} (default {default}; under torchrun: the launcher's WORLD_SIZE)"
    parser.add_argument(setting.flag, dest=name, default=default, help=help, **kwargs)


_OPTION_FLAGS = {
    "hsdp_shard_size": "--hsdp",
    "zero_hpz_partition_size": "--hpz",
}  # options this command's flags set


def _flagged(message: object) -> str:
    """A `RunConfig` or engine sentence with each `setting=value` written as the flag the user typed
    (`--flag value`), and each engine option this command sets as its flag."""
    pattern = r"\b(" + "|".join(_VALUE_FLAGS) + r")="
    text = re.sub(pattern, lambda m: f"{_VALUE_FLAGS[m.group(1)]} ", str(message))
    for option, flag in _OPTION_FLAGS.items():
        text = re.sub(rf"(options )?\[?'?\b{option}\b'?\]?", flag, text)
    return text


def register(subparsers) -> None:
    """Add the `compare` command to the `labkit` parser."""
    p = subparsers.add_parser(
        "compare",
        help="train engines side by side and measure them with the same probes",
        description="Train the lab's model with several engines (same weights, batches and AdamW) and "
        "measure each with the same probes: losses, step time, state and peak memory per rank, bytes per "
        "collective. Bytes are decimal: 1 MB = 1e6 B.",
    )
    p.add_argument(
        "--engines",
        type=_engine_list,
        default=[ORACLE, DDP],
        help=f"engines to compare, comma-separated, from {','.join(ENGINES)}",
    )
    for name, setting in SETTINGS.items():
        if setting.flag:
            _add_setting_flag(p, name, setting)
    p.add_argument(
        "--hsdp",
        type=_positive_int,
        nargs="?",
        const=0,
        default=None,
        metavar="RANKS",
        help="fsdp1, fsdp2, scratch: HSDP, shard groups of RANKS ranks (default: one node's, LOCAL_WORLD_SIZE) "
        "replicated across the others",
    )
    p.add_argument(
        "--hpz",
        type=_positive_int,
        nargs="?",
        const=0,
        default=None,
        metavar="RANKS",
        help="deepspeed: ZeRO++ hpZ, a secondary weight partition over RANKS ranks (default: one node's) "
        "for the backward all-gather",
    )
    p.add_argument(
        "--timeout", type=_positive_float, default=300.0, help="seconds per engine before giving up"
    )
    p.add_argument("--json", metavar="OUT", default=None, help="write the result as JSON to OUT")
    p.add_argument(
        "--trace",
        metavar="DIR",
        default=None,
        help="after the measured runs, trace each engine's last step under torch.profiler on every rank: "
        "DIR/<engine>-rank<r>.json, Chrome traces that ui.perfetto.dev opens (needs --steps 2 or more)",
    )
    p.add_argument(
        "--machine",
        metavar="FILE",
        default=None,
        help="a profile of `labkit calibrate --out FILE`: each engine's record gains predicted_step_s, the "
        "calibrated labkit.budget step, printed beside the measured one",
    )
    p.set_defaults(func=run)


def _group_size(flag: str, value: int | None, world_size: int) -> int | None:
    """`--hsdp` / `--hpz`: None when absent; its RANKS, or one node's ranks when given bare; checked."""
    from labkit.cluster import ranks_per_node

    if value is None:
        return None
    size = value or ranks_per_node(world_size)
    if world_size % size:
        raise UsageError(
            f"labkit compare: {flag} {size} does not divide --world-size {world_size}; pass a divisor of "
            f"{world_size}, e.g. the ranks of one node"
        )
    if flag == "--hsdp" and size == world_size:
        raise UsageError(
            f"labkit compare: --hsdp {size} is every rank of --world-size {world_size}: one shard group is plain "
            "full sharding, so it would change nothing; pass a smaller divisor, or drop --hsdp"
        )
    if flag == "--hpz" and size == 1:
        raise UsageError(
            "labkit compare: --hpz 1 keeps DeepSpeed's secondary weight partition on one rank, which is hpZ off; "
            "pass a divisor of the world size above 1, e.g. the ranks of one node, or drop --hpz"
        )
    return size


def _refuse_what_one_process_ignores(args: argparse.Namespace, cfg, launched: int | None) -> None:
    """With only single-rank engines (the oracle: one process, the global batch), a flag that sets how ranks
    share the work would be ignored: refuse it, naming it."""
    from labkit.engines.validation import ENGINE_SETTINGS, changed_settings

    if not all(ENGINES[e].single_rank for e in args.engines):
        return
    changed = changed_settings(cfg, (*ENGINE_SETTINGS, "link_gbytes"))
    given = [SETTINGS[s].flag for s in changed if SETTINGS[s].flag]
    given += [flag for flag, value in (("--hsdp", args.hsdp), ("--hpz", args.hpz)) if value is not None]
    if args.world_size is not None and launched is None:
        given.append("--world-size")
    if given:
        raise UsageError(
            f"labkit compare: {given[0]} sets how ranks share the work, and --engines {','.join(args.engines)} "
            "trains in one process on the global batch; drop it, or add an engine that runs on ranks"
        )


def _trace(engines: list[str], cfg, out_dir: str, timeout_s: float, speaks: bool) -> None:
    """`--trace DIR`: each engine traced in a launch of its own, after the measured runs (the profiler's own
    cost stays out of the measured steps), each rank's trace said as it is written."""
    from labkit import traces
    from labkit.engines.validation import options_for

    for name in engines:
        paths = traces.trace(name, options_for(name, cfg), out_dir, timeout_s)
        if speaks:
            print(
                f"labkit compare: {name} traced, step {cfg.steps - 1}: {', '.join(str(p) for p in paths)} "
                "(open in ui.perfetto.dev)",
                file=sys.stderr,
            )


def _predicted(engines: list[str], cfg, machine: dict) -> dict[str, float]:
    """Each engine's calibrated step (s) on the profiled machine, before any rank starts: a profile that cannot
    price this run is refused at once, not after it."""
    from labkit.calibrate import predicted_step_s
    from labkit.engines.validation import options_for

    try:
        return {name: predicted_step_s(name, options_for(name, cfg), machine) for name in engines}
    except ValueError as e:
        raise UsageError(f"labkit compare: --machine: {e}") from None


def _predicted_lines(result: dict, predicted: dict, machine: dict, load_before: tuple[float, ...]) -> str:
    """Add each engine's calibrated `predicted_step_s` to its record; the lines that show it beside the measured."""
    from labkit.calibrate import load_changed
    from labkit.tables import median_step_s

    lines = ["calibrated labkit.budget step (--machine) against the measured median step:"]
    if changed := load_changed(machine, load_before):
        lines.append(f"  note: {changed}")
    for name, record in result["engines"].items():
        record["predicted_step_s"] = predicted[name]
        measured = median_step_s(record)
        lines.append(
            f"  {name}: predicted {record['predicted_step_s']:.3f} s, measured {measured:.3f} s "
            f"(predicted/measured {record['predicted_step_s'] / measured:.2f})"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from labkit.budget import load_machine_profile
    from labkit.cluster import launcher_world_size, rank_limit
    from labkit.engines import loop
    from labkit.tables import compare_table

    load_before = os.getloadavg()  # before this command's ranks start, as calibrate reads its own
    if args.json:
        writable_file("compare", "--json", args.json)
    if args.trace:
        writable_folder("compare", "--trace", args.trace)
    try:
        machine = None if args.machine is None else load_machine_profile(args.machine)
    except ValueError as e:
        raise UsageError(f"labkit compare: --machine: {e}") from None

    launched = launcher_world_size()
    if args.trace and launched is not None:
        raise UsageError(
            "labkit compare: --trace starts launches of its own after the measured runs; run it without "
            "torchrun or the DeepSpeed launcher (labkit starts the ranks itself)"
        )
    if args.trace and args.steps < 2:
        raise UsageError(
            f"labkit compare: --trace records the last step after warm-up ones; pass --steps 2 or more, "
            f"not {args.steps}"
        )
    if launched is not None and args.world_size not in (None, launched):
        raise UsageError(
            f"labkit compare: --world-size {args.world_size} but the launcher started {launched} ranks "
            f"(nodes x ranks per node); pass --world-size {launched} or leave it out"
        )
    settings = {name: getattr(args, name) for name, s in SETTINGS.items() if s.flag}
    settings["world_size"] = args.world_size or launched or DEFAULTS["world_size"]
    try:
        cfg = RunConfig(**settings)
    except ValueError as e:
        raise UsageError(f"labkit compare: {_flagged(e)}") from None
    _refuse_what_one_process_ignores(args, cfg, launched)
    limit, why = rank_limit()
    if launched is None and cfg.world_size > limit and any(not ENGINES[e].single_rank for e in args.engines):
        raise UsageError(
            f"labkit compare: --world-size {cfg.world_size} but {why}; pass --world-size <= {limit}"
        )
    options = {}
    shard = _group_size("--hsdp", args.hsdp, cfg.world_size)
    if shard is not None:
        options["hsdp_shard_size"] = shard
    hpz = _group_size("--hpz", args.hpz, cfg.world_size)
    if hpz is not None:
        options["zero_hpz_partition_size"] = hpz
    cfg = replace(cfg, options=options)
    try:
        validation.validate(args.engines, cfg)  # what these engines make of the settings: said with the flags
    except ValueError as e:
        raise UsageError(f"labkit compare: {_flagged(e)}") from None
    predicted = None if machine is None else _predicted(args.engines, cfg, machine)
    speaks = launched is None or int(os.environ.get("RANK", "0")) == 0  # under a launcher: rank 0 only

    def progress(name: str, record: dict, wall_s: float) -> None:
        if not speaks:
            return
        print(
            f"labkit compare: {name} done in {wall_s:.1f} s, final loss {record['losses'][-1]:.6f}",
            file=sys.stderr,
        )

    result = loop.compare(args.engines, cfg, timeout_s=args.timeout, on_result=progress)
    if args.trace:
        _trace(args.engines, cfg, args.trace, args.timeout, speaks)
    if not speaks:
        return 0
    print(compare_table(result))
    if machine is not None:
        print(_predicted_lines(result, predicted, machine, load_before))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
