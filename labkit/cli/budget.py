"""`labkit budget`: print what `labkit.budget.plan()` returns for one configuration, as a table or JSON.

Only the standard library and `labkit.budget` are imported here, so the command never waits for torch
(beyond what `labkit/__init__` imports).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from labkit import budget
from labkit.cli import UsageError

# plan() names its arguments in Python; the user typed flags, so errors name the flag.
_FLAGS = {
    "params": "--params",
    "world_size": "--world-size",
    "group_size": "--group-size",
    "gpus_per_node": "--gpus-per-node",
    "strategy": "--strategy",
    "precision": "--precision",
    "offload_optimizer": "--offload-optimizer",
    "offload_params": "--offload-params",
    "tokens_per_rank": "--tokens-per-rank",
    "peak_tflops": "--peak-tflops",
    "mfu": "--mfu",
    "link_gbytes": "--link-gbytes",
    "intra_gbytes": "--intra-gbytes",
    "host_gbytes": "--host-gbytes",
    "nvme_gbytes": "--nvme-gbytes",
    "largest_layer_params": "--largest-layer-params",
    "layers": "--layers",
    "quant_block_elems": "--quant-block-elems",
    "accounting": "--accounting",
}
_FLAG_RE = re.compile(r"\b(" + "|".join(sorted(_FLAGS, key=len, reverse=True)) + r")\b")


def register(subparsers) -> None:
    """Add the `budget` command to the `labkit` parser."""
    p = subparsers.add_parser(
        "budget",
        help="memory, traffic and time per rank of one training step (closed form)",
        description="Closed-form memory per rank, traffic per rank per step and step time for data-parallel "
        "training (ddp, ZeRO-1/2/3, HSDP). Bytes are decimal: 1 GB = 1e9 B.",
    )
    p.add_argument("--params", type=float, required=True, help="model parameters, e.g. 30e9")
    p.add_argument("--world-size", type=int, required=True, help="data-parallel ranks, e.g. 256")
    p.add_argument("--strategy", choices=budget.STRATEGIES, default="zero3")
    p.add_argument("--group-size", type=int, default=None, help="hsdp shard group (default: one node)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node, for intra/inter-node links")
    p.add_argument("--precision", choices=tuple(budget.PRECISIONS), default="bf16_mixed")
    p.add_argument("--offload-optimizer", choices=budget.OFFLOAD_TARGETS, default="none")
    p.add_argument("--offload-params", choices=budget.OFFLOAD_TARGETS, default="none")
    p.add_argument(
        "--no-reshard-after-forward", action="store_true", help="keep gathered weights for backward"
    )
    p.add_argument("--no-prefetch", action="store_true", help="all-gather each layer only when it is needed")
    p.add_argument("--qwz", action="store_true", help="ZeRO++ int8 forward all-gather")
    p.add_argument("--hpz", action="store_true", help="ZeRO++ node-local backward all-gather")
    p.add_argument("--qgz", action="store_true", help="ZeRO++ int4 gradient reduce-scatter")
    p.add_argument("--quant-block-elems", type=int, default=None, help="elements per fp32 quantization scale")
    p.add_argument("--largest-layer-params", type=float, default=0, help="for gathered-buffer memory")
    p.add_argument("--layers", type=int, default=32, help="layers of the prefetch overlap model")
    p.add_argument("--tokens-per-rank", type=float, default=16384)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="peak TFLOP/s per rank")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOP utilisation, 0 < mfu <= 1")
    p.add_argument("--link-gbytes", type=float, default=50.0, help="inter-node GB/s per rank (NIC)")
    p.add_argument("--intra-gbytes", type=float, default=450.0, help="intra-node GB/s per rank (NVLink)")
    p.add_argument("--host-gbytes", type=float, default=25.0, help="GPU<->host GB/s (PCIe)")
    p.add_argument("--nvme-gbytes", type=float, default=5.0, help="host<->NVMe GB/s")
    p.add_argument("--accounting", choices=("paper", "deepspeed"), default="paper")
    p.add_argument(
        "--json", metavar="OUT", default=None, help="write the result as JSON to OUT ('-': stdout)"
    )
    p.set_defaults(func=run)


def _options(args: argparse.Namespace) -> dict:
    return {
        "group_size": args.group_size,
        "gpus_per_node": args.gpus_per_node,
        "precision": args.precision,
        "offload_optimizer": args.offload_optimizer,
        "offload_params": args.offload_params,
        "reshard_after_forward": not args.no_reshard_after_forward,
        "prefetch": not args.no_prefetch,
        "qwz": args.qwz,
        "hpz": args.hpz,
        "qgz": args.qgz,
        "quant_block_elems": args.quant_block_elems,
        "largest_layer_params": args.largest_layer_params,
        "layers": args.layers,
        "tokens_per_rank": args.tokens_per_rank,
        "peak_tflops": args.peak_tflops,
        "mfu": args.mfu,
        "link_gbytes": args.link_gbytes,
        "intra_gbytes": args.intra_gbytes,
        "host_gbytes": args.host_gbytes,
        "nvme_gbytes": args.nvme_gbytes,
        "accounting": args.accounting,
    }


def _count(n: int) -> str:
    """30000000000 -> '30B', 125000000 -> '125M'."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return str(n)


def format_table(result: dict) -> str:
    """The human table `labkit budget` prints."""
    head = (
        f"{_count(result['params'])} params on {result['world_size']} ranks, {result['strategy']}"
        + (
            f" (groups of {result['group_size']} x {result['replica_groups']})"
            if result["strategy"] == "hsdp"
            else ""
        )
        + f", {result['precision']} ({result['bytes_per_param']:g} B/param); 1 GB = 1e9 B"
        + (
            "; memory as DeepSpeed's estimator counts it (18 B/param + largest layer)"
            if result["accounting"] == "deepspeed"
            else ""
        )
    )
    rows = budget.summary_rows(result)
    width = max(len(q) for _, q, _ in rows)
    lines, section = [head], None
    for sec, quantity, value in rows:
        if sec != section:
            lines.append(f"\n{sec}")
            section = sec
        lines.append(f"  {quantity:<{width}}  {value:>12}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Compute the plan, print the table (unless JSON goes to stdout), write JSON if asked."""
    try:
        if args.largest_layer_params != int(args.largest_layer_params):
            raise ValueError(
                f"largest_layer_params must be a whole number; got {args.largest_layer_params!r}."
            )
        result = budget.plan(args.params, args.world_size, args.strategy, **_options(args))
    except ValueError as e:
        message = _FLAG_RE.sub(lambda m: _FLAGS[m.group(1)], str(e).strip().splitlines()[0])
        raise UsageError(f"labkit budget: {message}") from None
    text = json.dumps(result, indent=2)
    if args.json == "-":
        sys.stdout.write(text + "\n")
        return 0
    print(format_table(result))
    if args.json:
        try:
            with open(args.json, "w") as f:
                f.write(text + "\n")
        except OSError as e:
            raise UsageError(
                f"labkit budget: --json {args.json}: cannot write ({e.strerror}); pass a writable path or '-'."
            ) from None
    return 0
