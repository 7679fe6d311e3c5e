"""The shared training loop: every engine is built, stepped and measured the same way on every rank.

An engine is a module `labkit/engines/<name>.py` exposing

    build(cfg: RunConfig, model: nn.Module, rank_info: RankInfo) -> Engine

called on each rank inside an initialised default process group, with the lab's float32 CPU model
(`build_model(cfg.model, cfg.seed)`) and `RankInfo` (rank, world size, device, backend). `build` may wrap,
shard or move `model`, but must keep training the same `model.blocks[i]` objects (the loop hooks their
forward for the timeline). The returned object follows `labkit.engines.base.Engine`. Engines are imported
lazily by name (their row of `labkit.engines.registry.ENGINES`), so `deepspeed` is imported only for the
deepspeed engine. An object with that `build` method may stand in for a name (`EngineBuilder`: the
build-along's `labkit.buildalong.Learner`). A single-rank engine (`single`) runs on one rank with the global
batch; every other engine on `cfg.world_size` ranks, each with its slice.

Rank side (`train_rank`): install the probes -> build the engine -> barrier and zero the clocks -> per step:
batch, forward / backward / optimizer spans, local loss, step time, comm of the step; then one more step
for peak memory (`train_rank` says why). Nothing is
communicated inside a measured step but the engine's own collectives (no loss all-reduce: the parent
averages the ranks' local losses, which are means over equal slices).
Parent side: `run(engine, cfg)` launches the ranks and merges them into the contract's per-engine record;
`run_many(runs)` trains several (engine, cfg) runs in one launch; `compare(engines, cfg)` runs several
engines and adds the config.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import replace
from typing import Any, Protocol

import torch
import torch.distributed as dist

import labkit
from labkit import cluster
from labkit.engines.base import Engine, RankInfo, RunConfig
from labkit.engines.registry import DEEPSPEED, ENGINES
from labkit.engines.run_config import SETTINGS
from labkit.model import batch, build_model, count_params
from labkit.names import NVME
from labkit.probes import Probes, rank_clock, state_bytes, state_bytes_by_device

TIMELINE_STEPS = 2  # the last steps whose events `run` keeps
DEFAULT_TIMEOUT_S = 300.0


class EngineBuilder(Protocol):
    """An engine given as an object instead of a name: it builds the engine on each rank, as a module would."""

    def build(self, cfg: RunConfig, model: torch.nn.Module, rank_info: RankInfo) -> Engine: ...


class EngineUnavailable(ValueError):
    """An engine name that exists in the design but has no module in this checkout yet."""


def engine_module_name(name: str) -> str:
    """The module that builds engine `name` (its registry row's `module`)."""
    return ENGINES[name].module


def single_rank(engine: str | EngineBuilder) -> bool:
    """Whether `engine` runs on one rank with the global batch (an engine object, or a name `validate`
    refuses, does not)."""
    spec = ENGINES.get(engine) if isinstance(engine, str) else None
    return spec is not None and spec.single_rank


def available_engines() -> list[str]:
    """The engines of `ENGINES` whose module exists here (not imported)."""
    return [n for n in ENGINES if importlib.util.find_spec(engine_module_name(n)) is not None]


def ranks_for(engine: str, cfg: RunConfig) -> int:
    """How many ranks `engine` runs on for `cfg` (ranks)."""
    return 1 if single_rank(engine) else cfg.world_size


def validate(engines: Sequence[str], cfg: RunConfig) -> None:
    """Raise ValueError, one sentence naming the argument, for anything these engines could not do under `cfg`.

    The settings themselves were checked when `cfg` was built (`RunConfig`); here: the engines, and what
    each engine makes of the settings and options.
    """
    for name in engines:
        if not isinstance(name, str):
            if not callable(getattr(name, "build", None)):
                raise ValueError(
                    f"engine {name!r}: pass an engine name or an object with build(cfg, model, info)"
                )
            continue
        if name not in ENGINES:
            raise ValueError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
        if importlib.util.find_spec(engine_module_name(name)) is None:
            raise EngineUnavailable(
                f"engine {name!r} is not implemented yet (no labkit/engines/{name}.py); "
                f"available: {', '.join(available_engines())}"
            )
    if cfg.offload == NVME and any(e != DEEPSPEED and not single_rank(e) for e in engines):
        raise ValueError(
            "offload='nvme' is DeepSpeed's ZeRO-Infinity: only the deepspeed engine swaps to files; "
            "run the others with offload='cpu'"
        )
    check_options([e for e in engines if isinstance(e, str)], cfg)


def check_options(engines: Sequence[str], cfg: RunConfig) -> None:
    """Refuse, in the parent and in one sentence, an option that no engine of the run honours, and each
    engine's own impossible settings (its `check_run`), so that no flag is accepted and then ignored.

    Each engine is given only the options it honours (`options_for`), and its record says which; an option
    that none of the engines honours is refused. The checks are read from each engine's light module
    (its registry row's `checks_module`), so validating imports neither DeepSpeed nor FSDP1.
    """
    honoured: set[str] = set()
    for name in engines:
        checks = importlib.import_module(ENGINES[name].checks_module)
        honoured |= set(checks.OPTIONS)
        if hasattr(checks, "check_run"):
            checks.check_run(options_for(name, cfg))
    check_settings(engines, cfg)
    unknown = sorted(set(cfg.options) - honoured)
    if unknown:
        owners = [
            f"{k} is {' and '.join(e for e in ENGINES if k in engine_options(e)) or 'no engine'}'s"
            for k in unknown
        ]
        raise ValueError(
            f"options {unknown}: the engines of this run ({', '.join(engines)}) have no such setting, so it "
            f"would be ignored; {'; '.join(owners)}"
        )


# The RunConfig settings that only some engines read: those a registry row names, in the schema's order.
ENGINE_SETTINGS = tuple(s for s in SETTINGS if any(s in spec.settings for spec in ENGINES.values()))


def check_settings(engines: Sequence[str], cfg: RunConfig) -> None:
    """Refuse, in one sentence naming the setting and its flag, a non-default setting no engine of the run
    reads (e.g. `offload="cpu"` for ddp alone), as `check_options` refuses an option. The oracle (`single`)
    takes any of them alone or beside an engine that reads them: none changes its arithmetic."""
    others = [e for e in engines if not single_rank(e)]
    for setting in changed_settings(cfg) if others else ():
        if any(setting in engine_settings(e) for e in others):
            continue
        value, flag = getattr(cfg, setting), SETTINGS[setting].flag
        readers = ", ".join(e for e in ENGINES if setting in engine_settings(e))
        raise ValueError(
            f"{setting}={value!r}{f' ({flag})' if flag else ''}: the engines of this run "
            f"({', '.join(engines)}) have no such setting, so it would be ignored; it is {readers}'s"
        )


def changed_settings(cfg: RunConfig, names: Sequence[str] = ENGINE_SETTINGS) -> list[str]:
    """The settings of `names` (by default those only some engines read) that `cfg` sets to other than
    RunConfig's default."""
    default = RunConfig()
    return [name for name in names if getattr(cfg, name) != getattr(default, name)]


def engine_settings(name: str) -> tuple[str, ...]:
    """The RunConfig settings of `ENGINE_SETTINGS` that engine `name` reads (its registry row's `settings`)."""
    return ENGINES[name].settings


def engine_options(name: str) -> tuple[str, ...]:
    """The `cfg.options` keys engine `name` honours (the `OPTIONS` of its row's `checks_module`)."""
    return tuple(importlib.import_module(ENGINES[name].checks_module).OPTIONS)


def options_for(engine: str | EngineBuilder, cfg: RunConfig) -> RunConfig:
    """`cfg` with only the options `engine` honours (an engine object gets them all)."""
    if not isinstance(engine, str):
        return cfg
    keep = engine_options(engine)
    return replace(cfg, options={k: v for k, v in cfg.options.items() if k in keep})


# ------------------------------------------------------------------------------------------------ rank


def rank_info() -> RankInfo:
    """This rank's place and device, from the initialised default group.

    `backend` is the group's whole backend string ("gloo", or "cpu:gloo,cuda:nccl" on GPU ranks: CUDA
    tensors over NCCL, CPU ones over gloo); `device` is `cluster.rank_device`'s reading of it.
    """
    backend = str(dist.get_backend())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = cluster.rank_device(backend, local_rank)
    return RankInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def to_rank_device(x: Any, device: torch.device | None = None) -> Any:
    """`x` on this rank's device (`rank_info().device` unless `device` is given): a module (moved in place
    and returned), a tensor, or a tuple / list of them (a batch). The one place a rank-side helper puts
    its model and its batches: FSDP2 moves only a forward's inputs (the targets stay behind) and never its
    ignored parameters, so nothing is left to a wrapper."""
    device = device if device is not None else rank_info().device
    if isinstance(x, (tuple, list)):
        return type(x)(to_rank_device(t, device) for t in x)
    return x.to(device)


def rank_batch(
    step: int, model: str, seed: int, world_size: int = 1, rank: int = 0, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`labkit.model.batch` (this rank's slice of step `step`'s global batch) on this rank's device."""
    return to_rank_device(batch(step, model, seed, world_size, rank), device)


def rank_model(name: str, seed: int = 0, device: torch.device | None = None) -> torch.nn.Module:
    """`build_model(name, seed)` on this rank's device (for helpers that build a model without an engine)."""
    return to_rank_device(build_model(name, seed), device)


def comparison_device_type(cfg: RunConfig) -> str:
    """The one kind of device ("cpu" or "cuda") every run of a comparison at `cfg.world_size` ranks uses.

    `single`'s one rank runs there too, so the oracle never runs on a GPU while the others run on CPU
    ranks (a 1-GPU hub with world_size 2 to 4).
    """
    return cluster.placement(cfg.world_size).device_type


def train_rank(engine: str | EngineBuilder, cfg: RunConfig, peak: bool = True) -> dict[str, Any]:
    """Build `engine` on this rank, train `cfg.steps` timed steps under the probes, return what was measured.

    Peak memory is measured in one more step after the timed ones (step `cfg.steps`, its own batch): the
    CPU memory probe runs Python on every op (about 2x the step time of the tiny model), which must not
    enter the step times or the timeline. That step trains too; nothing of it is reported but the peak.
    With `peak=False` (a timing that needs no memory figure) that step is not run and the peak is None.
    """
    info = rank_info()
    cfg = options_for(engine, cfg)  # each engine sees the options it honours; its record says which
    # One intra-op thread per rank for every engine: the same compute per rank, so step times compare the
    # algorithms, not thread counts; and no OpenMP pool, which hangs in a rank forked from a parent that
    # had used one (a notebook that computed before launching).
    torch.set_num_threads(1)
    data_world_size, data_rank = (1, 0) if single_rank(engine) else (info.world_size, info.rank)
    nodes = cluster.rank_nodes()  # before the probes are installed: not counted
    # gloo's worker may still hold that all-gather's few output bytes (seen: 42 B on rank 0) when
    # `note_prior` counts what is live; the next collective on the group retires it first.
    dist.barrier()
    probes = Probes(info.rank, info.device, nodes=nodes)

    def batch_on(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rank_batch(step, cfg.model, cfg.seed, data_world_size, data_rank, info.device)

    with probes:
        module = importlib.import_module(engine_module_name(engine)) if isinstance(engine, str) else engine
        probes.memory.note_prior()  # what an earlier run in these ranks left alive is not this run's
        model = build_model(cfg.model, cfg.seed)
        eng = module.build(cfg, model, info)
        probes.timeline.watch_blocks(model)  # after build: the engine's own block hooks run first
        dist.barrier()  # outside a step: not counted
        probes.comm.emulate_link(cfg.link_gbytes)
        probes.timeline.reset_clock()
        losses, step_times_s = [], []
        for step in range(cfg.steps):
            loss, seconds = timed_step(eng, step, batch_on(step), probes)
            losses.append(loss.item())
            step_times_s.append(seconds)
        state = state_bytes(eng.state_tensors())
        state_by_device = state_bytes_by_device(eng.state_tensors())
        swapped = eng.swap_file_bytes() if hasattr(eng, "swap_file_bytes") else {}  # deepspeed's NVMe files
        peak_mem_bytes = None
        if peak:
            probes.memory.start(t for ts in eng.state_tensors().values() for t in ts)
            timed_step(eng, cfg.steps, batch_on(cfg.steps), probes)
            peak_mem_bytes = probes.memory.stop()
    last = cfg.steps - 1
    return {
        "rank": info.rank,
        "options": dict(cfg.options),
        "losses": losses,
        "step_time_s": step_times_s,
        "state_bytes": state,
        "state_bytes_by_device": state_by_device,
        "swap_file_bytes": swapped,
        "peak_mem_bytes": peak_mem_bytes,
        "mem_baseline_bytes": probes.memory.start_bytes,
        "mem_prior_bytes": probes.memory.prior_bytes,
        "comm": [probes.comm.summary(step) for step in range(cfg.steps)],
        "comm_by_link": probes.comm.link_summary(last),
        "nodes": nodes,
        "collective_calls": [c.to_dict() for c in probes.comm.calls if c.step == last],
        "timeline": [e for e in probes.timeline.events if e["step"] is not None and e["step"] <= last],
    }


def timed_step(
    eng: Engine, step: int, data: tuple[torch.Tensor, torch.Tensor], probes: Probes | None = None
) -> tuple[torch.Tensor, float]:
    """One training step on `data` (tokens, targets): (this rank's loss, detached float32; seconds it took).

    The clock (the rank's, `labkit.probes.clock`) covers forward, backward and the optimizer (and, on GPU,
    the wait for the device), not making the batch nor reading the loss. With `probes` (installed by the caller) the step's events and
    collectives are tagged with `step`; without, the same work runs bare (the benchmark of the probes'
    own cost compares the two).
    """
    tokens, targets = data
    span = probes.span if probes is not None else (lambda kind, name: nullcontext())
    clock = probes.timeline.clock if probes is not None else rank_clock(tokens.device.type)
    with probes.step(step) if probes is not None else nullcontext():
        start_s = clock.now()
        with span("compute", "forward"):
            loss = eng.forward_loss(tokens, targets)
        with span("compute", "backward"):
            eng.backward(loss)
        with span("compute", "optimizer"):
            eng.optimizer_step()
        if tokens.device.type == "cuda":
            torch.cuda.synchronize(tokens.device)
        seconds = clock.now() - start_s
    return loss.detach().float().clone(), seconds


def train_steps(
    eng: Engine,
    cfg: RunConfig,
    first_step: int = 0,
    dp: tuple[int, int] | None = None,
    probes: Probes | None = None,
) -> list[float]:
    """`cfg.steps` steps of `eng` from `first_step` on this rank; the global mean loss of each.

    The bare loop that the tests and the FSDP2 and DeepSpeed inspections share (`train_rank` adds timing,
    state and memory). `dp` = (data-parallel rank, data-parallel ranks) when not every rank takes its own
    slice (tensor parallelism, HSDP's replicas); by default each rank of the world takes one. The mean is an
    all-reduce after the step, outside what `probes` (installed by the caller) count.
    """
    dp_rank, dp_size = dp or (dist.get_rank(), dist.get_world_size())
    device = rank_info().device
    losses = []
    for step in range(first_step, first_step + cfg.steps):
        loss, _ = timed_step(
            eng, step, rank_batch(step, cfg.model, cfg.seed, dp_size, dp_rank, device), probes
        )
        dist.all_reduce(loss)  # every rank of a data replica holds the same loss: the mean is over the world
        losses.append(loss.item() / dist.get_world_size())
    return losses


# ---------------------------------------------------------------------------------------------- parent


def run(engine: str | EngineBuilder, cfg: RunConfig, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
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


def run_many(runs: Sequence[tuple[str, RunConfig]], timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Several (engine, cfg) runs in ONE launch; each run's record (as `run` returns it), in order.

    Each rank trains the runs one after the other with `train_rank` (the same probes as `run`); sharing
    the ranks saves a start-up and a DeepSpeed import per run (seconds each on a laptop). All runs need the
    same number of ranks (`single` cannot share a launch with multi-rank engines: `run` it), and a
    DeepSpeed hpZ run must be alone (DeepSpeed keeps its hpZ groups for the process; measured: the next
    run in the same ranks gathered inside them too).

    What an earlier run left alive is not in a later run's `peak_mem_bytes` or `mem_baseline_bytes`; its
    `mem_prior_bytes` says how much there was. The scratch, ddp and fsdp2 engines leave nothing; DeepSpeed
    and FSDP1 leave their model behind, held by hooks in autograd's C++ side that `gc` cannot free
    (measured on `small` at 2 ranks: 145 MB and 55 MB per run).
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
    per_rank = labkit.launch(_train_runs, sizes.pop(), runs, timeout=timeout_s, device_type=device_type)
    return [merge_ranks([r[i] for r in per_rank], cfg.steps) for i, (_, cfg) in enumerate(runs)]


def _train_runs(runs: Sequence[tuple[str, RunConfig]]) -> list[dict[str, Any]]:
    """Rank side of `run_many`: `train_rank` once per run, in order, a barrier after each."""
    out = []
    for engine, cfg in runs:
        out.append(train_rank(engine, cfg))
        dist.barrier()
    return out


def merge_ranks(ranks: Sequence[dict[str, Any]], steps: int) -> dict[str, Any]:
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
    validate(engines, cfg)
    out = {
        "config": {**cfg.to_dict(), "n_params": count_params(build_model(cfg.model, cfg.seed))},
        "engines": {},
    }
    for name in engines:
        start_s = time.perf_counter()
        out["engines"][name] = run(name, options_for(name, cfg), timeout_s)  # each its own options
        if on_result is not None:
            on_result(name, out["engines"][name], time.perf_counter() - start_s)
    return out
