"""The parent side of the shared loop: launch the ranks, merge what they measured into one record per engine.

An engine is a module `labkit/engines/<name>.py` exposing

    build(cfg: RunConfig, model: nn.Module, rank_info: RankInfo) -> Engine

called on each rank inside an initialised default process group, with the lab's float32 CPU model
(`build_model(cfg.model, cfg.seed)`) and `RankInfo` (rank, world size, device, backend). `build` may wrap,
shard or move `model`, but must keep training the same `model.blocks[i]` objects (the loop hooks their
forward for the timeline). The returned object follows `labkit.engines.base.Engine`. Engines are imported
lazily by name (their row of `labkit.engines.registry.ENGINES`), so `deepspeed` is imported only for the
deepspeed engine.

Three jobs, three modules: `labkit.engines.validation` checks a request once, at the entry of `run`,
`run_many` and `compare`; `labkit.engines.on_rank` trains on every rank (`train_rank`); here `run(engine, cfg)`
launches the ranks and merges them into the contract's per-engine record (`EngineRecord`), `run_many(runs)`
trains several (engine, cfg) runs in one launch, and `compare(engines, cfg)` runs several engines and adds
the config.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypedDict

import labkit
from labkit import cluster
from labkit.engines.base import RunConfig
from labkit.engines.on_rank import train_rank, train_runs
from labkit.engines.validation import EngineBuilder, ranks_for, single_rank, validate
from labkit.model import build_model, count_params

TIMELINE_STEPS = 2  # the last steps whose events `run` keeps
DEFAULT_TIMEOUT_S = 300.0


class EngineRecord(TypedDict):
    """One engine's result in the `labkit compare` contract (`run` says what each key holds); a dict, so that
    it is the JSON `labkit compare --json` writes."""

    options: dict[str, Any]
    losses: list[float]
    step_time_s: list[float]
    state_bytes: dict[str, int]
    state_bytes_by_device: dict[str, dict[str, int]]
    swap_file_bytes: dict[str, int]
    peak_mem_bytes: list[int | None]
    mem_baseline_bytes: list[int]
    mem_prior_bytes: list[int]
    comm: dict[str, dict[str, int]]
    collective_calls: list[dict[str, Any]]
    comm_by_link: dict[str, dict[str, int]]
    nodes: list[int]
    timeline: list[dict[str, Any]]


def comparison_device_type(cfg: RunConfig) -> str:
    """The one kind of device ("cpu" or "cuda") every run of a comparison at `cfg.world_size` ranks uses.

    `single`'s one rank runs there too, so the oracle never runs on a GPU while the others run on CPU
    ranks (a 1-GPU hub with world_size 2 to 4).
    """
    return cluster.placement(cfg.world_size).device_type


# ---------------------------------------------------------------------------------------------- parent


def run(engine: str | EngineBuilder, cfg: RunConfig, timeout_s: float = DEFAULT_TIMEOUT_S) -> EngineRecord:
    """Train `engine` under `cfg` and return its record of the `labkit compare` contract.

    losses: the global mean loss per step (mean of the ranks' local means: the slices are equal);
    step_time_s: the slowest rank's per step; state_bytes: rank 0's, after the last step (what it keeps
    on its device); state_bytes_by_device: rank 0's, every state tensor (host buffers too) by the device
    it lives on; peak_mem_bytes: per rank, over one step after the timed ones, and mem_baseline_bytes
    what was live when that step began, both less mem_prior_bytes, what was live before the run began
    (`labkit.probes.memory`); comm: rank 0's collectives of the last step
    (steady state: the first step may differ, e.g. DeepSpeed tracing its fetch order);
    collective_calls: rank 0's calls of the last step, one by one, with their group;
    comm_by_link: the last step's wire bytes of EVERY rank, summed, per collective, split into
    intra_node_bytes / inter_node_bytes by the ring rule of `labkit.probes.comm` (predicted by
    `labkit.budget.ring_link_bytes`); nodes: each rank's node (0, 1, ...), from its launcher;
    timeline: every rank's events of the last `TIMELINE_STEPS` steps, seconds from the common zero
    (a barrier before step 0).
    """
    validate([engine], cfg)
    return _launched(engine, cfg, timeout_s)


def _launched(engine: str | EngineBuilder, cfg: RunConfig, timeout_s: float) -> EngineRecord:
    """`run` of a request already validated: the ranks launched, their results merged."""
    launched = cluster.launcher_world_size()
    if launched is not None and single_rank(engine):
        # Under torchrun every rank exists already: each runs the oracle on the global batch (the same
        # numbers on every rank, no collective inside a step) and rank 0's record is the engine's.
        return merge_ranks(labkit.launch(train_rank, launched, engine, cfg)[:1], cfg.steps)
    device_type = comparison_device_type(cfg)
    ranks = labkit.launch(
        train_rank, ranks_for(engine, cfg), engine, cfg, timeout=timeout_s, device_type=device_type
    )
    return merge_ranks(ranks, cfg.steps)


def run_many(runs: Sequence[tuple[str, RunConfig]], timeout_s: float = 600.0) -> list[EngineRecord]:
    """Several (engine, cfg) runs in ONE launch; each run's record (as `run` returns it), in order.

    Each rank trains the runs one after the other with `train_rank` (the same probes as `run`); sharing
    the ranks saves a start-up and a DeepSpeed import per run (seconds each on a laptop). All runs need the
    same number of ranks (`single` cannot share a launch with multi-rank engines: `run` it), and a
    DeepSpeed hpZ run must be alone (DeepSpeed keeps its hpZ groups for the process: the next run in the
    same ranks gathers inside them too).

    What an earlier run left alive is not in a later run's `peak_mem_bytes` or `mem_baseline_bytes`; its
    `mem_prior_bytes` says how much there was. The scratch, ddp and fsdp2 engines leave nothing; DeepSpeed
    and FSDP1 leave their model behind, held by hooks in autograd's C++ side that `gc` cannot free
    (docs/measured.md).
    """
    runs = list(runs)
    if not runs:
        return []
    if len(runs) > 1 and any(int(cfg.options.get("zero_hpz_partition_size", 1)) > 1 for _, cfg in runs):
        raise ValueError(
            "a run with zero_hpz_partition_size > 1 needs a launch of its own: DeepSpeed keeps its hpZ process "
            "groups across deepspeed.initialize calls, so the runs after it in the same ranks would use them"
        )
    sizes = {ranks_for(engine, cfg) for engine, cfg in runs}
    if len(sizes) != 1:
        raise ValueError(f"run_many needs runs on one number of ranks; these need {sorted(sizes)}")
    for engine, cfg in runs:
        validate([engine], cfg)
    device_type = comparison_device_type(max((cfg for _, cfg in runs), key=lambda c: c.world_size))
    per_rank = labkit.launch(train_runs, sizes.pop(), runs, timeout=timeout_s, device_type=device_type)
    return [merge_ranks([r[i] for r in per_rank], cfg.steps) for i, (_, cfg) in enumerate(runs)]


def merge_ranks(ranks: Sequence[dict[str, Any]], steps: int) -> EngineRecord:
    """The per-engine record (see `run`) from each rank's `train_rank` result, in rank order."""
    first_kept = max(0, steps - TIMELINE_STEPS)
    return {
        "options": ranks[0]["options"],  # the run's options this engine honoured
        "losses": [statistics.fmean(r["losses"][i] for r in ranks) for i in range(steps)],
        "step_time_s": [max(r["step_time_s"][i] for r in ranks) for i in range(steps)],
        "state_bytes": ranks[0]["state_bytes"],
        "state_bytes_by_device": ranks[0]["state_bytes_by_device"],
        "swap_file_bytes": ranks[0]["swap_file_bytes"],
        "peak_mem_bytes": [r["peak_mem_bytes"] for r in ranks],
        "mem_baseline_bytes": [r["mem_baseline_bytes"] for r in ranks],
        "mem_prior_bytes": [r["mem_prior_bytes"] for r in ranks],
        "comm": ranks[0]["comm"][-1],
        "collective_calls": ranks[0]["collective_calls"],
        "comm_by_link": sum_link_bytes(r["comm_by_link"] for r in ranks),
        "nodes": ranks[0]["nodes"],
        "timeline": [e for r in ranks for e in r["timeline"] if e["step"] >= first_kept],
    }


def sum_link_bytes(per_rank) -> dict[str, dict[str, int]]:
    """{kind: {"intra_node_bytes", "inter_node_bytes"}} summed over ranks' `link_summary` dicts."""
    out: dict[str, dict[str, int]] = {}
    for summary in per_rank:
        for kind, row in summary.items():
            total = out.setdefault(kind, {"intra_node_bytes": 0, "inter_node_bytes": 0})
            for key, value in row.items():
                total[key] += value
    return out


def compare(
    engines: Sequence[str],
    cfg: RunConfig,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    on_result: Callable[[str, dict[str, Any], float], None] | None = None,
) -> dict[str, Any]:
    """Run each engine in turn; {"config": {..., "n_params"}, "engines": {name: record}}.

    Each engine gets the options of `cfg` that it honours (its record's "options"); an option that no
    engine of the list honours is refused (`check_options`).

    `on_result(name, record, wall_s)` is called as each engine finishes (progress for long runs).
    """
    validate(engines, cfg)  # once, for every engine: each run below is part of this request
    out = {
        "config": {**cfg.to_dict(), "n_params": count_params(build_model(cfg.model, cfg.seed))},
        "engines": {},
    }
    for name in engines:
        start_s = time.perf_counter()
        out["engines"][name] = _launched(name, cfg, timeout_s)  # each rank keeps the options it honours
        if on_result is not None:
            on_result(name, out["engines"][name], time.perf_counter() - start_s)
    return out
