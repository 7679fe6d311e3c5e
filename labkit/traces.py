"""A `torch.profiler` trace of one training step on every rank: `labkit compare --trace DIR` and
benchmarks/profile_step.py.

`trace(engine, cfg, out_dir)` trains `cfg.steps` steps of `engine` with the lab's loop (`on_rank.train_rank`,
its probes and batches) in a launch of its own, the profiler recording only the last step (the earlier
ones are warm-up: DeepSpeed traces its order over its first two). Each rank writes
`out_dir/<engine>-rank<r>.json`, a Chrome trace that Perfetto (ui.perfetto.dev) and `chrome://tracing`
open. The profiler costs time of its own, so a traced step is not a measured one: `labkit compare`
measures its engines first and traces them after.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import labkit
from labkit.cluster import rank_environ
from labkit.engines import on_rank, validation
from labkit.engines.base import RunConfig


@dataclass(eq=False)
class Profiled:
    """Engine `engine` as a builder of the lab's loop, stepping `profiler` as each training step starts
    (a forward pre-hook on the model, before the engine wraps it)."""

    engine: str
    profiler: Any

    @property
    def name(self) -> str:
        return self.engine

    def build(self, cfg: RunConfig, model: torch.nn.Module, info):
        model.register_forward_pre_hook(lambda *_: self.profiler.step())
        return importlib.import_module(validation.engine_module_name(self.engine)).build(cfg, model, info)


def trace_path(out_dir: str | os.PathLike, engine: str, rank: int) -> Path:
    """Where rank `rank`'s trace of `engine` is written."""
    return Path(out_dir) / f"{engine}-rank{rank}.json"


def trace_rank(engine: str, cfg: RunConfig, out_dir: str, rows: int = 10) -> str:
    """On each rank: train `cfg` with `engine`, profiling the last step, and write this rank's trace
    (`trace_path`). Returns the table of its ops with the most self time (device time on a GPU)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    if cfg.steps < 2:
        raise ValueError(f"steps={cfg.steps}: a trace needs 2 or more (the last is the one recorded)")
    cuda = on_rank.rank_info().device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    path = trace_path(out_dir, engine, torch.distributed.get_rank())
    # step k of the profiler starts as timed step k - 1 does: record timed step cfg.steps - 1 alone
    when = schedule(wait=cfg.steps - 1, warmup=1, active=1, repeat=1)
    with profile(
        activities=activities, schedule=when, on_trace_ready=lambda p: p.export_chrome_trace(str(path))
    ) as prof:
        on_rank.train_rank(Profiled(engine, prof), cfg, peak=False)
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows)


def trace(engine: str, cfg: RunConfig, out_dir: str | os.PathLike, timeout_s: float = 300.0) -> list[Path]:
    """`engine` under `cfg` traced on each of its ranks (a launch of its own); the traces' paths, in rank
    order. `out_dir` is made if it does not exist."""
    from labkit.engines.loop import comparison_device_type

    validation.validate([engine], cfg)
    n = validation.ranks_for(engine, cfg)
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    device_type = comparison_device_type(cfg)
    # read as each rank's profiler starts: above its USDT level, no line per start and stop
    with rank_environ({"KINETO_LOG_LEVEL": "6"}, keep_set=True):
        labkit.launch(trace_rank, n, engine, cfg, str(out), timeout=timeout_s, device_type=device_type)
    return [trace_path(out, engine, r) for r in range(n)]
