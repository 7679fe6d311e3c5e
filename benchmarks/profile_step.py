"""One training step per engine under `torch.profiler`: where each engine's step time goes, as a trace.

    python benchmarks/profile_step.py [--engines scratch,fsdp2,deepspeed,ddp] [--model small]
                                      [--world-size N] [--steps 4] [--out DIR]

Each engine trains `--steps` steps with the lab's loop (`on_rank.train_rank`, its probes and batches); the
profiler records only the last of them (the earlier ones are warm-up: DeepSpeed traces its order over its
first two). Rank 0 writes `DIR/<engine>.json`, a Chrome trace that Perfetto (ui.perfetto.dev) and
`chrome://tracing` open, the format FSDP users read; the script prints each engine's ten ops with the most
self time, CUDA time first where there is a GPU. It runs on CPU ranks too (gloo), where it shows the same
split of a step between the engines' own Python, the model's ops and the collectives.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

import labkit
from labkit import cluster
from labkit.engines import on_rank, validation
from labkit.engines.base import RunConfig
from labkit.engines.registry import ENGINES as REGISTERED

ENGINES = ("scratch", "fsdp2", "deepspeed", "ddp")


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


def profile_rank(engine: str, cfg: RunConfig, out_dir: str, rows: int = 10) -> str:
    """On each rank: train `cfg` with `engine`, profiling the last timed step; rank 0 writes its trace to
    `out_dir/<engine>.json`. Returns the table of the ops with the most self time (device time on a GPU)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    if cfg.steps < 2:
        raise ValueError(f"steps={cfg.steps}: profile_rank needs 2 or more (the last is the one recorded)")
    cuda = on_rank.rank_info().device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    path = os.path.join(out_dir, f"{engine}.json")

    def write(prof) -> None:
        if torch.distributed.get_rank() == 0:
            prof.export_chrome_trace(path)

    # step k of the profiler starts as timed step k - 1 does: record timed step cfg.steps - 1 alone
    when = schedule(wait=cfg.steps - 1, warmup=1, active=1, repeat=1)
    with profile(activities=activities, schedule=when, on_trace_ready=write) as prof:
        on_rank.train_rank(Profiled(engine, prof), cfg)
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--model", default="small")
    parser.add_argument(
        "--world-size", type=int, default=None, help="default: one rank per GPU (up to 4), else 2"
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/traces")
    args = parser.parse_args(argv)
    engines = args.engines.split(",")
    unknown = [e for e in engines if e not in REGISTERED or REGISTERED[e].single_rank]
    if unknown or args.steps < 2:
        why = (
            f"--engines {unknown[0]!r} is not a sharded engine here"
            if unknown
            else "--steps must be 2 or more"
        )
        print(f"benchmarks/profile_step.py: {why}", file=sys.stderr)
        return 2
    world_size = args.world_size or min(cluster.visible_gpus() or 2, 4)
    os.makedirs(args.out, exist_ok=True)
    for engine in engines:
        cfg = RunConfig(model=args.model, world_size=world_size, steps=args.steps)
        table = labkit.launch(profile_rank, world_size, engine, cfg, os.path.abspath(args.out))[0]
        print(f"## {engine}: {args.model}, {world_size} rank(s), step {args.steps - 1} (rank 0)\n{table}")
        print(f"trace: {os.path.join(args.out, engine + '.json')} (open it in ui.perfetto.dev)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
