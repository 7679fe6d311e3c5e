"""The rank side of the shared loop: every engine is built, stepped and measured the same way on every rank.

`train_rank`: install the probes -> build the engine -> barrier and zero the clocks -> per step: batch,
forward / backward / optimizer spans, local loss, step time, comm of the step; then one more step for peak
memory (`train_rank` says why). Nothing is communicated inside a measured step but the engine's own
collectives (no loss all-reduce: the parent averages the ranks' local losses, which are means over equal
slices). `rank_info`, `rank_batch` and `rank_model` put this rank's model and batches on its device, in one
place; `timed_step` and `train_steps` are the bare steps that helpers and inspections share.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from labkit import cluster
from labkit.engines.base import Engine, RankInfo, RunConfig
from labkit.engines.validation import EngineBuilder, engine_module_name, options_for, single_rank
from labkit.model import batch, build_model
from labkit.probes import Probes, rank_clock, state_bytes, state_bytes_by_device


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
    # gloo's worker may still hold that all-gather's few output bytes when
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


def train_runs(runs: Sequence[tuple[str, RunConfig]]) -> list[dict[str, Any]]:
    """Rank side of `labkit.engines.loop.run_many`: `train_rank` once per run, in order, a barrier after each."""
    out = []
    for engine, cfg in runs:
        out.append(train_rank(engine, cfg))
        dist.barrier()
    return out
