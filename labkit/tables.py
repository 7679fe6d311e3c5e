"""Fixed-width text tables, and the summaries of a run's record that they print.

One formatter (`fixed_width`) lays out every table the notebooks and `labkit compare` print; one
`median_step_s` is what "step time" means wherever a record is summed up. A record is the per-engine dict
of the `labkit compare` contract (`labkit.engines.loop.run`); a plan is what `labkit.budget.plan` returns.
Pure Python: no torch, so the CLI can print without importing it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from labkit import budget
from labkit.engines.registry import ORACLE
from labkit.names import HSDP, STEP_KINDS

# ------------------------------------------------------------------------------------------ the formatter


def fixed_width(rows: Sequence[Sequence[str]], rule: bool = False) -> str:
    """Rows of text cells (the first row is the header) as aligned lines, columns two spaces apart.

    Each column is as wide as its widest cell; the first is left-aligned, the others right-aligned
    (numbers). `rule` draws a line of dashes under the header.
    """
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in rows
    ]
    if rule:
        lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ one record


def median_step_s(record: dict[str, Any]) -> float:
    """The record's typical step time (seconds; each step's time is its slowest rank's).

    The median over the steps after step 0 when there are more than one: step 0 includes warm-up (first
    allocations, lazy initialisation, DeepSpeed tracing its fetch order, compilation), which is not the
    steady state the later steps measure. A one-step record's median is that step.
    """
    times = record["step_time_s"]
    return statistics.median(times[1:] if len(times) > 1 else times)


def phase_s(record: dict[str, Any], name: str, rank: int = 0) -> float:
    """Mean seconds of one loop phase ("forward", "backward", "optimizer") on `rank` over the kept steps."""
    spans = [
        e["end_s"] - e["start_s"]
        for e in record["timeline"]
        if e["kind"] == "compute" and e["name"] == name and e["rank"] == rank
    ]
    return statistics.fmean(spans) if spans else 0.0


def wire_bytes(record: dict[str, Any], kind: str | None = None) -> int:
    """Wire bytes one rank sent in the record's last step: of collective `kind`, or of all (bytes)."""
    comm = record["comm"]
    if kind is not None:
        return comm.get(kind, {}).get("wire_bytes", 0)
    return sum(v["wire_bytes"] for v in comm.values())


# ------------------------------------------------------------------------------------------ records


def records_table(records: dict[str, dict[str, Any]], reference: str = ORACLE) -> str:
    """One row per record: last loss, largest relative loss difference to `reference`, wire bytes per
    collective, state bytes and peak memory per rank, median step time."""
    ref = records.get(reference, {}).get("losses")
    rows = [
        (
            "engine",
            "last loss",
            "max rel diff",
            "all-gather B",
            "reduce-scat B",
            "all-reduce B",
            "state B/rank",
            "peak B/rank",
            "step ms",
        )
    ]
    for name, rec in records.items():
        diff = max(abs(a - b) / abs(b) for a, b in zip(rec["losses"], ref, strict=True)) if ref else 0.0
        rows.append(
            (
                name,
                f"{rec['losses'][-1]:.6f}",
                f"{diff:.1e}",
                *(f"{wire_bytes(rec, kind):,}" for kind in STEP_KINDS),
                f"{sum(rec['state_bytes'].values()):,}",
                f"{max(rec['peak_mem_bytes']):,}",
                f"{median_step_s(rec) * 1e3:.0f}",
            )
        )
    return fixed_width(rows, rule=True)


def compare_table(result: dict[str, Any]) -> str:
    """The table `labkit compare` prints: a title line, one row per engine, and, for runs across nodes,
    each engine's intra/inter-node bytes per collective."""
    cfg = result["config"]
    reference = result["engines"].get(ORACLE, {}).get("losses")
    rows = [
        (
            "engine",
            "final loss",
            f"max|d {ORACLE}|",
            "step ms",
            "state/rank",
            "all-gather",
            "reduce-scatter",
            "all-reduce",
            "peak mem",
        )
    ]
    for name, rec in result["engines"].items():
        diff = (
            f"{max(abs(a - b) for a, b in zip(rec['losses'], reference, strict=True)):.2e}"
            if reference
            else "-"
        )
        rows.append(
            (
                name,
                f"{rec['losses'][-1]:.6f}",
                diff,
                f"{median_step_s(rec) * 1e3:.1f}",
                budget.format_bytes(sum(rec["state_bytes"].values())),
                *(budget.format_bytes(wire_bytes(rec, kind)) for kind in STEP_KINDS),
                budget.format_bytes(max(rec["peak_mem_bytes"])),
            )
        )
    title = (
        f"model {cfg['model']} ({cfg['n_params']:,} params), world size {cfg['world_size']}, {cfg['steps']} steps, "
        f"{cfg['dtype']}; wire bytes per rank in the last step (rank 0), peak mem = the largest rank's"
    )
    return "\n".join([title, fixed_width(rows), *_link_table(result)])


def _link_table(result: dict[str, Any]) -> list[str]:
    """Runs across nodes: each engine's intra/inter-node bytes per collective, all ranks summed."""
    records = {
        n: r for n, r in result["engines"].items() if max(r.get("nodes") or [0]) > 0 and r["comm_by_link"]
    }
    if not records:
        return []
    rows = [("engine", "nodes", *(f"{k.replace('_', '-')} intra/inter" for k in STEP_KINDS))]
    for name, rec in records.items():
        links = rec["comm_by_link"]
        rows.append(
            (
                name,
                str(max(rec["nodes"]) + 1),
                *(
                    f"{budget.format_bytes(links.get(k, {}).get('intra_node_bytes', 0))} / "
                    f"{budget.format_bytes(links.get(k, {}).get('inter_node_bytes', 0))}"
                    for k in STEP_KINDS
                ),
            )
        )
    head = "bytes on intra-node / inter-node links in the last step, all ranks summed (ring rule: docs/cluster.md)"
    return [head, fixed_width(rows)]


def offload_rows(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per record: state bytes the engine keeps as device tensors, the optimizer phase and step (seconds).

    `device_state_bytes` sums the engine's "params", "grads" and "optimizer" tensors, which is what stays on
    the accelerator; an engine that offloads keeps its host buffers out of those keys (the scratch engine
    lists them as "host_optimizer"), so the difference between a run and its offloaded twin is what moved.
    """
    return [
        {
            "run": name,
            "device_state_bytes": sum(rec["state_bytes"].values()),
            "optimizer_state_bytes": rec["state_bytes"].get("optimizer", 0),
            "peak_mem_bytes": max(rec["peak_mem_bytes"]),
            "optimizer_phase_s": phase_s(rec, "optimizer"),
            "step_s": median_step_s(rec),
        }
        for name, rec in records.items()
    ]


def offload_table(records: dict[str, dict[str, Any]]) -> str:
    """`offload_rows` as a table: bytes with thousands separators, the optimizer phase and step in ms."""
    rows = [("run", "engine state B", "optimizer B", "peak B", "optimizer ms", "step ms")]
    for row in offload_rows(records):
        rows.append(
            (
                row["run"],
                f"{row['device_state_bytes']:,}",
                f"{row['optimizer_state_bytes']:,}",
                f"{row['peak_mem_bytes']:,}",
                f"{row['optimizer_phase_s'] * 1e3:.1f}",
                f"{row['step_s'] * 1e3:.0f}",
            )
        )
    return fixed_width(rows)


# ------------------------------------------------------------------------------------------ plans


def scale_rows(scenarios: dict[str, dict[str, Any]]) -> str:
    """A table of plans, one row per scenario: GPU, host and NVMe bytes per rank, offload and step time (s)."""
    rows = [("scenario", "GPU/rank", "host/rank", "NVMe/rank", "offload s", "step s")]
    for name, p in scenarios.items():
        rows.append(
            (
                name,
                budget.format_bytes(p["gpu_bytes_per_rank"]),
                budget.format_bytes(sum(p["host_bytes_per_rank"].values())),
                budget.format_bytes(sum(p["nvme_bytes_per_rank"].values())),
                f"{p['offload_time_s']:.2f}",
                f"{p['step_time_s']:.2f}",
            )
        )
    return fixed_width(rows, rule=True)


def strategy_rows(plans: dict[str, dict[str, Any]]) -> str:
    """A table of plans: state per rank, copies of the weights, traffic by link, comm and exposed time (s)."""
    rows = [("scenario", "state/rank", "copies", "intra-node B", "inter-node B", "comm s", "exposed s")]
    for name, p in plans.items():
        links = p["traffic_bytes_by_link"]
        rows.append(
            (
                name,
                budget.format_bytes(p["state_bytes_per_rank"]),
                str(p["copies_in_cluster"]["weights"]),
                budget.format_bytes(links.get("intra_node", 0)),
                budget.format_bytes(links.get("inter_node", 0)),
                f"{p['comm_time_s']:.2f}",
                f"{p['exposed_comm_s']:.2f}",
            )
        )
    return fixed_width(rows, rule=True)


# Plan arithmetic lives in labkit.budget; notebook 07 calls it by this name.
needs_offload = budget.needs_offload


# ------------------------------------------------------------------------------------------ one plan


def plan_table(result: dict) -> str:
    """A plan of `labkit.budget.plan` as the sectioned table `labkit budget` prints.

    Its head says the model, the strategy and, for `labkit budget --world-size auto` (a `fewest_ranks` key),
    why that many ranks; its sections end with the step time's assumptions and the verdict.
    """
    head = (
        f"{budget.format_count(result['params'])} params"
        + (
            f" ({budget.format_count(result['trained_params'])} trained, the rest frozen)"
            if result["trained_params"] != result["params"]
            else ""
        )
        + f" on {result['world_size']} ranks, {result['strategy']}"
        + (
            f" (groups of {result['group_size']} x {result['replica_groups']})"
            if result["strategy"] == HSDP
            else ""
        )
        + f", {result['precision']} ({result['bytes_per_param']:g} B/param); 1 GB = 1e9 B"
        + (
            "; memory as DeepSpeed's estimator counts it (18 B/param + largest layer)"
            if result["accounting"] == "deepspeed"
            else ""
        )
    )
    lines = [head]
    if "fewest_ranks" in result:
        lines.append(f"fewest ranks that fit: {result['fewest_ranks']['reason']}")
    rows = budget.summary_rows(result)
    # a figure is aligned in its column; a sentence (a verdict) follows its quantity on its own line
    figures = [(q, v) for _, q, v in rows if len(v) <= _FIGURE_WIDTH]
    aligned = iter(fixed_width([("", ""), *((f"  {q}", v) for q, v in figures)]).splitlines()[1:])
    section = None
    for sec, quantity, value in rows:
        if sec != section:
            lines.append(f"\n{sec}")
            section = sec
        lines.append(next(aligned).rstrip() if len(value) <= _FIGURE_WIDTH else f"  {quantity}: {value}")
    return "\n".join(lines)


_FIGURE_WIDTH = 20  # wider values are sentences
