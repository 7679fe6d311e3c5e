"""Searches over plans: the fewest ranks at which a strategy fits, and the smallest offload that lets
ZeRO-3 fit at the most ranks you can have.
"""

from __future__ import annotations

import math

from labkit.fields import check
from labkit.names import HSDP, NVME, ZERO3

from .inputs import DEFAULTS, INPUTS
from .planner import plan
from .quantities import format_bytes

MAX_RANKS = 2**20  # the fewest-ranks search gives up beyond a million ranks


def fewest_ranks(
    params: float, strategy: str = DEFAULTS["strategy"], *, max_ranks: int = MAX_RANKS, **options
) -> dict:
    """The smallest world size at which `strategy` with `options` fits (`plan()["fits"]`: GPU and host RAM).

    Memory per rank never grows with n, so the search is a bisection over the world sizes the plan accepts
    (a multiple of the hsdp group; whole nodes for accounting="deepspeed"). Returns `world_size` (None when
    nothing fits at `max_ranks`), its `plan`, `one_fewer` (the largest accepted size below it, which does not
    fit) and `reason`, one sentence.
    """
    options.pop("world_size", None)
    gpn = _checked("gpus_per_node", options.get("gpus_per_node", DEFAULTS["gpus_per_node"]))
    step = 1  # the accepted world sizes from one node up are the multiples of `step`
    if strategy == HSDP:
        step = gpn if options.get("group_size") is None else _checked("group_size", options["group_size"])
    if options.get("accounting") == "deepspeed":
        step = math.lcm(step, gpn)
    first = -(-gpn // step) * step
    top = plan(params, max(first, max_ranks // step * step), strategy, **options)  # a bad input raises here
    small = [r for n in range(1, first) if (r := _plan_or_none(params, n, strategy, options))]
    fitting = [r for r in small if r["fits"]]
    if fitting:
        found, below = (
            fitting[0],
            ([r for r in small if r["world_size"] < fitting[0]["world_size"]] or [None])[-1],
        )
    elif not top["fits"]:
        return {
            "world_size": None,
            "max_ranks": top["world_size"],
            "plan": None,
            "one_fewer": None,
            "reason": _nothing_fits(top),
        }
    else:
        lo, hi = first // step, top["world_size"] // step  # hi fits; find the smallest k that does
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if plan(params, mid * step, strategy, **options)["fits"] else (mid + 1, hi)
        found = plan(params, lo * step, strategy, **options)
        below = (
            plan(params, (lo - 1) * step, strategy, **options)
            if lo > first // step
            else (small or [None])[-1]
        )
    return _fewest_ranks_answer(found, below, top["world_size"])


def _checked(name: str, value):
    """`value` checked as the field `name` of PlanInputs checks it (a bad one raises ValueError)."""
    spec = next(i.spec for i in INPUTS if i.name == name)
    return check(name, value, spec)


def _plan_or_none(params: float, n: int, strategy: str, options: dict) -> dict | None:
    try:
        return plan(params, n, strategy, **options)
    except ValueError:  # a world size this strategy does not accept (a group that does not divide it)
        return None


def _fewest_ranks_answer(found: dict, below: dict | None, max_ranks: int) -> dict:
    n, fmt = found["world_size"], format_bytes
    reason = (
        f"{n} ranks are the fewest at which {found['strategy']} fits: "
        f"{fmt(found['gpu_needed_bytes_per_rank'])} per rank of {fmt(found['gpu_memory_bytes'])}"
    )
    one_fewer = None
    if below is not None:
        one_fewer = {
            k: below[k] for k in ("world_size", "gpu_needed_bytes_per_rank", "host_bytes_per_node", "fits")
        }
        reason += f"; at {below['world_size']} ranks it needs {fmt(below['gpu_needed_bytes_per_rank'])}"
    return {
        "world_size": n,
        "max_ranks": max_ranks,
        "plan": found,
        "one_fewer": one_fewer,
        "reason": reason + ".",
    }


def _nothing_fits(top: dict) -> str:
    """Why no world size fits: the plan at the largest one tried, in one sentence."""
    fmt = format_bytes
    n, strategy = top["world_size"], top["strategy"]
    if not top["fits_gpu_memory"]:
        parts = [f"state {fmt(top['state_bytes_per_rank'])}"]
        transient = sum(top["transient_bytes_per_rank"].values())
        if transient:
            parts.append(f"transient buffers {fmt(transient)}")
        if top["activation_bytes_per_rank"]:
            parts.append(f"activations {fmt(top['activation_bytes_per_rank'])}")
        return (
            f"nothing fits in gpu_memory_bytes={fmt(top['gpu_memory_bytes'])}: even at {n:,} ranks {strategy} needs "
            f"{fmt(top['gpu_needed_bytes_per_rank'])} per rank ({', '.join(parts)}); shard more (zero3), offload, "
            "or checkpoint activations."
        )
    return (
        f"nothing fits in host_memory_bytes={fmt(top['host_memory_bytes'])}: even at {n:,} ranks the offloaded "
        f"state needs {fmt(top['host_bytes_per_node'])} per node; offload to nvme or add host RAM."
    )


_REMEDIES = (("cpu", "none"), ("cpu", "cpu"), (NVME, "cpu"), (NVME, NVME))  # smallest offload first


def needs_offload(params: float, max_ranks: int, gpu_memory_bytes: float, **options) -> dict:
    """The first reversal condition: does ZeRO-3 fit at the largest world size you can have?

    Returns the GPU bytes per rank at `max_ranks`, whether they fit `gpu_memory_bytes`, and the smallest
    offload (optimizer to cpu, then params too, then NVMe) under which the GPU and the node's host RAM
    (`host_memory_bytes`, an option) both fit, or None; `tried` says how each offload fared.
    """
    options = {**options, "gpu_memory_bytes": gpu_memory_bytes}
    full = plan(params, max_ranks, ZERO3, **options)
    remedy, tried = None, []
    for opt, par in () if full["fits_gpu_memory"] else _REMEDIES:
        p = plan(params, max_ranks, ZERO3, offload_optimizer=opt, offload_params=par, **options)
        tried.append(
            {
                "offload_optimizer": opt,
                "offload_params": par,
                **{
                    k: p[k]
                    for k in (
                        "gpu_bytes_per_rank",
                        "host_bytes_per_node",
                        "fits_gpu_memory",
                        "fits_host_memory",
                        "host_verdict",
                    )
                },
            }
        )
        if p["fits"]:
            remedy = {
                "offload_optimizer": opt,
                "offload_params": par,
                "gpu_bytes_per_rank": p["gpu_bytes_per_rank"],
                "host_bytes_per_node": p["host_bytes_per_node"],
            }
            break
    return {
        "gpu_bytes_per_rank": full["gpu_bytes_per_rank"],
        "fits_without_offload": full["fits_gpu_memory"],
        "offload": remedy,
        "tried": tried,
    }
