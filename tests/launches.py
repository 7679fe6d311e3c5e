"""Several rank-side jobs in ONE launch, so that the engine tests share their ranks (starting ranks, and
loading DeepSpeed's ops in each, costs seconds).

`launch_jobs(n, jobs)` runs every job (a function and its arguments) on each of `n` ranks, in order, with a
barrier after each, and returns {job name: its result}: rank 0's, every rank's (`per_rank`), or, for a
`train(engine, cfg)` job, the record `loop.run` returns (`on_rank.train_rank` on every rank, merged). A job sees
what the jobs before it left in its ranks, as the runs of `loop.run_many` do: DeepSpeed and FSDP1 leave their
model alive (a later run's memory figures are relative to it), and a DeepSpeed hpZ run goes last.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

import labkit
from labkit.engines import loop, on_rank, validation
from labkit.engines.base import RunConfig

TIMEOUT_S = 600.0  # several jobs, and a cold cache of DeepSpeed's CPU ops (~3 min) under the first


@dataclass(frozen=True)
class Job:
    """`fn(*args, **kwargs)` on every rank; `steps` set: a `train_rank` result, merged as `loop.run` does;
    `per_rank`: every rank's result in rank order, not rank 0's alone."""

    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    per_rank: bool = False
    steps: int | None = None


def job(fn: Callable[..., Any], *args: Any, per_rank: bool = False, **kwargs: Any) -> Job:
    """`fn(*args, **kwargs)` on every rank of the launch; its result: rank 0's (every rank's with `per_rank`)."""
    return Job(fn, args, kwargs, per_rank=per_rank)


def train(engine: str, cfg: RunConfig) -> Job:
    """`engine` trained under `cfg` by the loop's `train_rank`; its result: the record `loop.run` returns."""
    return Job(on_rank.train_rank, (engine, cfg), steps=cfg.steps)


def _run_jobs(jobs: list[Job]) -> list[Any]:
    """Rank side: each job in turn, a barrier after each (no rank starts a job while another ends one)."""
    out = []
    for j in jobs:
        out.append(j.fn(*j.args, **j.kwargs))
        dist.barrier()
    return out


def launch_jobs(n: int, jobs: dict[str, Job], timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """{name: result} of every job, from one launch of `n` ranks (each training job validated first, in the
    parent, as `loop.run` validates it)."""
    for j in jobs.values():
        if j.steps is not None:
            validation.validate([j.args[0]], j.args[1])
    per_rank = labkit.launch(_run_jobs, n, list(jobs.values()), timeout=timeout_s)
    out = {}
    for i, (name, j) in enumerate(jobs.items()):
        results = [r[i] for r in per_rank]
        if j.steps is not None:
            out[name] = loop.merge_ranks(results, j.steps)
        else:
            out[name] = results if j.per_rank else results[0]
    return out


def launched_on_demand(jobs_at: Callable[[int], dict[str, Job]], timeout_s: float = TIMEOUT_S):
    """`get(n)`: `launch_jobs(n, jobs_at(n))`, launched the first time a test asks for `n` ranks, then kept
    (a module fixture returns it, so every test of the module reads the same launch)."""
    launched: dict[int, dict[str, Any]] = {}

    def get(n: int) -> dict[str, Any]:
        if n not in launched:
            launched[n] = launch_jobs(n, jobs_at(n), timeout_s)
        return launched[n]

    return get
