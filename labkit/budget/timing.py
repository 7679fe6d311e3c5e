"""Step time: compute, the comm each phase exposes with and without prefetch, offload transfers, CPU Adam;
also the exposed floor of a unit plan, one collective's seconds, and MFU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from labkit.names import ALL_GATHER, NVME, REDUCE_SCATTER

from .inputs import PRECISIONS, PlanInputs
from .machine import machine_collective_s, machine_flops_per_s, machine_sync_s
from .memory import _OPTIMIZER_TERMS, Memory
from .traffic import LINKS, Term


def offload_io_bytes(p: PlanInputs, mem: Memory) -> tuple[int, int]:
    """(PCIe, NVMe) bytes one rank moves per step for its offloaded state."""
    w_b, g_b = PRECISIONS[p.precision]["weights"], PRECISIONS[p.precision]["grads"]
    host_io = nvme_io = 0
    if p.offload_optimizer != "none":
        sh = mem.elems["master"]
        grad_shard = mem.elems["grads"] if mem.shard["grads"] > 1 else sh
        host_io += grad_shard * g_b + sh * w_b  # gradient shard down, updated weight shard back up
        if p.offload_optimizer == NVME:
            nvme_io += 2 * sum(mem.resident[t] for t in _OPTIMIZER_TERMS)  # read and write back master, m, v
    if p.offload_params != "none":
        # the shard goes up for the forward and the backward all-gather
        host_io += 2 * mem.resident["weights"]
        if p.offload_params == NVME:
            nvme_io += 3 * mem.resident["weights"]  # two reads, one write of the updated shard
    return host_io, nvme_io


def _overlap_exposed_s(comm_s: float, compute_s: float, layers: int) -> float:
    """Exposed seconds of `comm_s` hidden behind `compute_s`, both split evenly over `layers` layers.

    With one layer of look-ahead, layer i's compute runs while layer i+1's collective is in flight, so the
    phase takes c + (L-1) max(c, k) + k for per-layer comm c and compute k; the exposed part is that minus
    the compute: c + (L-1) max(0, c - k).
    """
    if comm_s <= 0:
        return 0.0
    c, k = comm_s / layers, compute_s / layers
    return c + (layers - 1) * max(0.0, c - k)


class UnitCost(NamedTuple):
    """One unit of a ZeRO-3 unit plan, in forward order, as `exposed_floor` weighs it (wire bytes, one rank)."""

    name: str
    gather_wire_bytes: int  # one all-gather of its weights
    reduce_wire_bytes: int  # its reduce-scatter
    backward_gather: bool  # gathered again before its backward (False: kept since its forward)
    computes: bool  # has compute of its own beside which a collective can run (an embedding lookup has none)
    forward_gather: bool = True  # gathered before its forward here (False: only its backward side is)


def exposed_floor(
    units: Sequence[UnitCost],
    prefetch_depth: int = 1,
    collective_s: Callable[[str, int], float] | None = None,
) -> dict:
    """What no prefetch of `prefetch_depth` units can hide: the collectives with no compute beside them.

    Forward, in unit order: a unit's gather runs beside the compute of the `depth` units before it (the first
    unit's beside none). Backward, in reverse order: a unit's gather beside the `depth` units after it in
    that order began, its reduce-scatter beside every unit whose backward follows. A collective whose units
    beside it have no compute is exposed at any link speed. Returns the exposed (unit, collective) pairs,
    their wire bytes, the step's, and the share: the floor of exposed / unprefetched comm, by bytes.

    `collective_s(kind, wire_bytes)`: one collective's seconds ("all_gather" or "reduce_scatter"), e.g.
    `collective_time_s` on a calibrated machine; with it the result also has "floor_s" and "comm_s", the
    same sums in seconds, where a collective's fixed cost (gloo's latency) weighs too.
    """
    order, exposed = list(units), []
    back = order[::-1]
    for i, u in enumerate(order):
        if u.forward_gather and not any(v.computes for v in order[max(0, i - prefetch_depth) : i]):
            exposed.append((u.name, "forward all-gather", ALL_GATHER, u.gather_wire_bytes))
    for i, u in enumerate(back):
        if u.backward_gather and not any(v.computes for v in back[max(0, i - prefetch_depth) : i]):
            exposed.append((u.name, "backward all-gather", ALL_GATHER, u.gather_wire_bytes))
        if not any(v.computes for v in back[i + 1 :]):
            exposed.append((u.name, "reduce-scatter", REDUCE_SCATTER, u.reduce_wire_bytes))
    every = [
        c
        for u in order
        for c in ((ALL_GATHER, u.gather_wire_bytes),) * (u.forward_gather + u.backward_gather)
    ]
    every += [(REDUCE_SCATTER, u.reduce_wire_bytes) for u in order]
    total = sum(b for _, b in every)
    floor = sum(b for *_, b in exposed)
    out = {
        "exposed": [(name, what) for name, what, *_ in exposed],
        "floor_wire_bytes": floor,
        "comm_wire_bytes": total,
        "floor_share": floor / total if total else 0.0,
    }
    if collective_s is not None:
        out["floor_s"] = sum(collective_s(kind, b) for *_, kind, b in exposed)
        out["comm_s"] = sum(collective_s(kind, b) for kind, b in every)
    return out


def collective_time_s(
    kind: str, wire_bytes: int, world_size: int, link_gbytes: float | None = None, machine: dict | None = None
) -> float:
    """Seconds of one collective on one rank: the longer of the link's time (wire bytes / `link_gbytes`
    GB/s) and the backend's own on a calibrated `machine` (`machine_collective_s`, one call); 0 with neither."""
    link_s = wire_bytes / (link_gbytes * 1e9) if link_gbytes else 0.0
    backend_s = machine_collective_s(machine, kind, world_size, wire_bytes, 1) if machine else 0.0
    return max(link_s, backend_s)


def gathered_peak_bytes(unit_bytes: Sequence[int], prefetch_depth: int = 1, prefetch: bool = True) -> int:
    """The most gathered weight bytes held at once: a unit computing and the `prefetch_depth` gathered ahead
    of it, the largest such run of consecutive units (forward order; the backward's runs are the same). A
    last unit kept across the forward/backward turn adds nothing: it is freed once its gradients are
    reduced, before the unit before it computes its backward."""
    window = prefetch_depth + 1 if prefetch else 1
    return max(sum(unit_bytes[i : i + window]) for i in range(len(unit_bytes)))


def host_optimizer_time_s(p: PlanInputs, mem: Memory) -> float:
    """CPU Adam's own seconds per step when the optimizer is offloaded: this rank's params / its rate.

    The host updates this rank's optimizer shard (`mem.elems["master"]` parameters) at
    `host_adam_params_per_s` after the gradients have come down; the GPU waits (no one-step-delayed update).
    """
    if p.offload_optimizer == "none":
        return 0.0
    return mem.elems["master"] / p.host_adam_params_per_s


def sync_wait_s(p: PlanInputs, terms: list[Term], machine: dict | None) -> float:
    """Seconds a step waits for the ranks' drift: without prefetch each all-gather of the forward and the
    backward is waited on as it is issued, so every rank waits there for the last to arrive, which costs a
    `machine` profile's `sync_s` per wait (with prefetch the next block's compute absorbs the drift); 0
    without a profile (a datasheet plan has no drift to price)."""
    if p.prefetch or not machine:
        return 0.0
    waits = sum(t.calls for t in terms if t.collective == ALL_GATHER and t.phase in ("forward", "backward"))
    return waits * machine_sync_s(machine, p.world_size)


def step_time(
    p: PlanInputs,
    terms: list[Term],
    offload_time_s: float,
    host_adam_s: float = 0.0,
    machine: dict | None = None,
) -> dict:
    """Compute time, serial and exposed comm (with and without prefetch) and the step, in seconds.

    Compute is 6 N tokens / (peak x MFU), or / a `machine` profile's rate per rank
    (`machine_flops_per_s`); a third forward and two thirds backward (activation checkpointing adds a
    forward inside the backward: 8 N tokens). Each phase's link time overlaps its compute by
    `_overlap_exposed_s`; the backend's own time (`Term.backend_s`: on a CPU its copies run on the cores
    that compute), the after-step all-gather, the offload transfers and CPU Adam do not overlap; without
    prefetch each rank also waits for the last to arrive at every all-gather (`sync_wait_s`).
    """
    per_token = 8.0 if p.activation_checkpointing else 6.0
    flops = per_token * p.params * p.tokens_per_rank
    rate = machine_flops_per_s(machine, p.world_size) if machine else p.peak_tflops * 1e12 * p.mfu
    compute_time_s = flops / rate
    fwd_k = 2 * compute_time_s / per_token
    bwd_k = compute_time_s - fwd_k
    by_phase = {"forward": 0.0, "backward_gather": 0.0, "backward_reduce": 0.0, "step": 0.0}
    time_by_link = dict.fromkeys(LINKS, 0.0)
    for t in terms:
        phase = t.phase
        if phase == "backward":
            phase = "backward_gather" if t.collective == ALL_GATHER else "backward_reduce"
        by_phase[phase] += t.time_s - t.backend_s
        time_by_link[t.link] += t.time_s
    comm_time_s = sum(time_by_link.values())
    backend_s = sum(t.backend_s for t in terms)
    exposed_prefetch = backend_s + (
        _overlap_exposed_s(by_phase["forward"], fwd_k, p.layers)
        + _overlap_exposed_s(by_phase["backward_gather"] + by_phase["backward_reduce"], bwd_k, p.layers)
        + by_phase["step"]
    )
    exposed_no_prefetch = backend_s + (
        by_phase["forward"]
        + by_phase["backward_gather"]
        + _overlap_exposed_s(by_phase["backward_reduce"], bwd_k, p.layers)
        + by_phase["step"]
    )
    waits_s = sync_wait_s(p, terms, machine)  # 0 with prefetch
    exposed = (exposed_prefetch if p.prefetch else exposed_no_prefetch) + waits_s
    return {
        "flops_per_rank": flops,
        "compute_time_s": compute_time_s,
        "comm_time_s": comm_time_s,
        "comm_time_by_link_s": time_by_link,
        "backend_comm_time_s": backend_s,
        "comm_to_compute": comm_time_s / compute_time_s,
        "exposed_comm_s": exposed,
        "exposed_comm_prefetch_s": exposed_prefetch,
        "exposed_comm_no_prefetch_s": exposed_no_prefetch,
        "sync_wait_s": waits_s,
        "offload_time_s": offload_time_s,
        "host_optimizer_time_s": host_adam_s,
        "step_time_s": compute_time_s + exposed + offload_time_s + host_adam_s,
    }


def model_flops_utilisation(params: float, tokens: float, step_time_s: float, peak_flops: float) -> float:
    """MFU: the 6 x params x tokens FLOPs a training step needs (forward 2, backward 4 per parameter and
    token), over the step's time, over the device's peak FLOP/s (a fraction; attention's FLOPs left out)."""
    if min(params, tokens, step_time_s, peak_flops) <= 0:
        raise ValueError("params, tokens, step_time_s and peak_flops must all be positive")
    return 6 * params * tokens / step_time_s / peak_flops
