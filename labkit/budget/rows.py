"""Reading a plan: its numbers as (section, quantity, value) rows of text, for the CLI's table and the
widgets; the assumptions each with its unit.
"""

from __future__ import annotations

from labkit.names import NVME

from .inputs import INPUTS
from .quantities import format_bytes, format_count


def summary_rows(result: dict) -> list[tuple[str, str, str]]:
    """The numbers of a `plan()` result as (section, quantity, value) rows, for tables in the CLI and widgets."""
    return (
        _memory_rows(result)
        + _traffic_rows(result)
        + _time_rows(result)
        + assumption_rows(result)
        + _fit_rows(result)
    )


def _unit_value(value: float, unit: str) -> str:
    if unit == "bytes":
        return format_bytes(value)
    if unit == "params/s":
        return f"{format_count(value)} params/s"
    return f"{value:g} {unit}".rstrip() if unit != "fraction" else f"{value:g}"


def assumption_rows(result: dict) -> list[tuple[str, str, str]]:
    """The inputs the step time rests on (`labkit.fields.Spec.assumption`), each with its unit."""
    specs = {i.name: i.spec for i in INPUTS}
    return [
        ("assumptions", specs[name].help.split(";")[0], _unit_value(value, specs[name].unit))
        for name, value in result["assumptions"].items()
    ]


def _fit_rows(result: dict) -> list[tuple[str, str, str]]:
    section = "does it fit?"
    rows = [
        (section, "GPU memory", format_bytes(result["gpu_memory_bytes"])),
        (section, "needed per rank", format_bytes(result["gpu_needed_bytes_per_rank"])),
        (section, "left for activations", format_bytes(result["gpu_left_for_activations_bytes"])),
        (section, "verdict, GPU", result["gpu_verdict"]),
    ]
    if result["host_bytes_per_node"]:
        rows.append((section, "host RAM per node", format_bytes(result["host_memory_bytes"])))
        rows.append((section, "offloaded state per node", format_bytes(result["host_bytes_per_node"])))
        rows.append((section, "verdict, host", result["host_verdict"]))
    return rows


def _memory_rows(result: dict) -> list[tuple[str, str, str]]:
    section = "memory per rank"
    rows = [(section, term, format_bytes(value)) for term, value in result["memory_bytes_per_rank"].items()]
    rows.append((section, "state total", format_bytes(result["state_bytes_per_rank"])))
    if "state_gib_per_rank" in result:
        rows.append((section, "state total (GiB, DeepSpeed)", f"{result['state_gib_per_rank']:.2f} GiB"))
    transient = sum(result["transient_bytes_per_rank"].values())
    if transient:
        rows.append((section, "transient buffers", format_bytes(transient)))
    if result["activation_bytes_per_rank"]:
        kept = (
            "block inputs, one block recomputed"
            if result["options"]["activation_checkpointing"]
            else "all saved"
        )
        rows.append(
            (
                section,
                f"activations ({kept}; peak at the {result['activation_peak_at']})",
                format_bytes(result["activation_bytes_per_rank"]),
            )
        )
    for where in ("host", NVME):
        held = sum(result[f"{where}_bytes_per_rank"].values())
        if held:
            rows.append((section, f"on {where} (offloaded)", format_bytes(held)))
    rows.append((section, "whole model's state, once", format_bytes(result["static_bytes_total"])))
    rows.append(
        (section, "copies of the weights in the cluster", f"{result['copies_in_cluster']['weights']}")
    )
    return rows


def _traffic_rows(result: dict) -> list[tuple[str, str, str]]:
    section = "traffic per rank per step"
    rows = []
    for t in result["traffic_terms"]:
        where = "intra-node" if t["link"] == "intra_node" else "inter-node"
        rows.append(
            (section, f"{t['name']} ({t['group_size']} ranks, {where})", format_bytes(t["wire_bytes"]))
        )
    rows.append((section, "total", format_bytes(result["traffic_bytes_per_rank"])))
    rows.append(
        (section, "total as n grows (no (n-1)/n)", format_bytes(result["traffic_bytes_per_rank_large_n"]))
    )
    for link, value in result["traffic_bytes_by_link"].items():
        rows.append((section, f"on {link.replace('_', '-')} links", format_bytes(value)))
    if result["host_io_bytes_per_rank"] or result["nvme_io_bytes_per_rank"]:
        rows.append((section, "to/from host (PCIe)", format_bytes(result["host_io_bytes_per_rank"])))
        rows.append((section, "to/from NVMe", format_bytes(result["nvme_io_bytes_per_rank"])))
    return rows


def _time_rows(result: dict) -> list[tuple[str, str, str]]:
    rows = [
        ("compute" + (" (calibrated rate)" if result["machine"] else ""), result["compute_time_s"]),
        ("communication (serial)", result["comm_time_s"]),
        *(
            [("of which the backend's own (calibrated)", result["backend_comm_time_s"])]
            if result["machine"]
            else []
        ),
        ("exposed comm, one-layer prefetch", result["exposed_comm_prefetch_s"]),
        ("exposed comm, no prefetch", result["exposed_comm_no_prefetch_s"]),
    ]
    if result["sync_wait_s"]:
        rows.append(("waiting for the last rank at each all-gather (calibrated)", result["sync_wait_s"]))
    if result["offload_time_s"]:
        rows.append(("offload transfers", result["offload_time_s"]))
    if result["host_optimizer_time_s"]:
        rows.append(("host optimizer (CPU Adam)", result["host_optimizer_time_s"]))
    rows.append(("step", result["step_time_s"]))
    return [("time per step", quantity, f"{seconds:.3f} s") for quantity, seconds in rows]
