"""When FSDP stops hiding its communication: the tokens per rank at which a step's link time equals its compute.

A ZeRO-3 step sends three collectives of the whole model per rank (the forward all-gather, the backward
all-gather, the reduce-scatter), each (n-1)/n x N x b bytes on the wire for N parameters of b bytes, and
computes 6 N FLOPs per token. Its link time is 3 (n-1)/n N b / B for a link of B bytes/s, its compute
6 N T / R for T tokens per rank at R FLOP/s, so the two are equal at

    T* = (b / 2) x (n-1)/n x R / B      tokens per rank (8 N per token with activation checkpointing: x 6/8)

N cancels: the threshold is the chip's rate over its link. Above T*, one unit of look-ahead hides every
collective but the floor (`timing.exposed_floor`); below it the step waits on the link. `critical_tokens`
reads T* off a full `plan`, whose link time also knows HSDP's groups, ZeRO++ and the node boundary;
`closed_form_critical_tokens` is the formula above, and the two agree where the formula's assumptions hold
(zero3, every collective on the one link). `largest_useful_world_size` turns T* into the most ranks a global
batch can keep busy.
"""

from __future__ import annotations

from labkit.names import ZERO3

from .inputs import DEFAULTS, PRECISIONS
from .planner import plan
from .search import MAX_RANKS


def closed_form_critical_tokens(
    flops_per_s: float, link_bytes_per_s: float, weight_bytes: float = 2.0, world_size: int | None = None
) -> float:
    """T* = (b / 2) x (n-1)/n x R / B, in tokens per rank: R the FLOP/s one rank computes at, B its link's
    bytes/s, b the bytes of one gathered weight; `world_size` None takes (n-1)/n as 1 (a large n)."""
    if min(flops_per_s, link_bytes_per_s, weight_bytes) <= 0:
        raise ValueError("flops_per_s, link_bytes_per_s and weight_bytes must all be above 0")
    ring = 1.0 if world_size is None else (world_size - 1) / world_size
    return weight_bytes / 2 * ring * flops_per_s / link_bytes_per_s


def critical_tokens(params: float, world_size: int, strategy: str = ZERO3, **options) -> dict:
    """The tokens per rank at which `plan(params, world_size, strategy, **options)`'s link time equals its
    compute (the compute grows with the tokens, the link time does not), beside the plan's own figures.

    Returns {"critical_tokens_per_rank", "tokens_per_rank" (the plan's), "comm_to_compute" (at those tokens),
    "comm_time_s", "compute_time_s", "closed_form_tokens_per_rank"} (seconds per step, one rank). The
    closed form uses the plan's rate (peak x MFU), its inter-node link and its weight bytes.
    """
    at = plan(params, world_size, strategy, **options)
    o = at["options"]
    tokens = o["tokens_per_rank"]
    critical = tokens * at["comm_time_s"] / at["compute_time_s"]
    per_token = 8.0 if o["activation_checkpointing"] else 6.0
    closed = closed_form_critical_tokens(
        o["peak_tflops"] * 1e12 * o["mfu"] * 6.0 / per_token,
        o["link_gbytes"] * 1e9,
        PRECISIONS[at["precision"]]["weights"],
        world_size,
    )
    return {
        "critical_tokens_per_rank": critical,
        "tokens_per_rank": tokens,
        "comm_to_compute": at["comm_to_compute"],
        "comm_time_s": at["comm_time_s"],
        "compute_time_s": at["compute_time_s"],
        "closed_form_tokens_per_rank": closed,
    }


def largest_useful_world_size(
    params: float,
    global_tokens: float,
    strategy: str = ZERO3,
    max_ranks: int = MAX_RANKS,
    tensor_parallel: int = 1,
    **options,
) -> dict:
    """The most ranks, in whole nodes, that a step of `global_tokens` keeps compute-bound: each rank's share
    global_tokens / n at or above that n's critical tokens per rank (`critical_tokens`).

    `tensor_parallel` t > 1 puts t ranks of a node on each layer (TP inside the node): FSDP then runs over
    n / t data-parallel groups of t ranks, each rank holding and computing 1/t of the model, so the groups'
    tokens must clear the same threshold and the world size is t x theirs. TP's own activation all-reduces
    stay on the node's links and are not priced here. Returns {"world_size" (None when even one node is
    link-bound), "tokens_per_rank" (of one data-parallel group), "critical_tokens_per_rank", "next": the same
    at the next node count, where it no longer holds (None past `max_ranks`)}.
    """
    if not global_tokens > 0:
        raise ValueError(f"global_tokens={global_tokens!r}: pass the tokens of one step, above 0")
    gpn = options.pop("gpus_per_node", DEFAULTS["gpus_per_node"])
    if tensor_parallel < 1 or gpn % tensor_parallel:
        raise ValueError(
            f"tensor_parallel={tensor_parallel!r}: pass a divisor of gpus_per_node={gpn}, so TP stays inside a node"
        )
    groups_per_node = gpn // tensor_parallel

    def at(nodes: int) -> dict:
        groups = nodes * groups_per_node
        share = global_tokens / groups
        options_here = {**options, "tokens_per_rank": share, "gpus_per_node": groups_per_node}
        critical = critical_tokens(params / tensor_parallel, groups, strategy, **options_here)
        return {
            "world_size": groups * tensor_parallel,
            "tokens_per_rank": share,
            "critical_tokens_per_rank": critical["critical_tokens_per_rank"],
        }

    def busy(row: dict) -> bool:
        return row["tokens_per_rank"] >= row["critical_tokens_per_rank"]

    # A group's share falls with n and the threshold rises with it, so "busy" holds up to one node count.
    low, high = 0, max_ranks // gpn + 1  # busy at `low` nodes (0: none yet), not busy at `high`
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if busy(at(mid)) else (low, mid)
    best = at(low) if low else {"world_size": None, "tokens_per_rank": None, "critical_tokens_per_rank": None}
    return {**best, "next": at(high) if high * gpn <= max_ranks else None}
