"""One training step per engine under `torch.profiler`: where each engine's step time goes, as a trace.

    python benchmarks/profile_step.py [--engines scratch,fsdp2,deepspeed,ddp] [--model small]
                                      [--world-size N] [--steps 4] [--out DIR]

Each engine trains `--steps` steps with the lab's loop (`on_rank.train_rank`, its probes and batches); the
profiler records only the last of them (the earlier ones are warm-up: DeepSpeed traces its order over its
first two). Each rank writes `DIR/<engine>-rank<r>.json` (`labkit.traces`), a Chrome trace that Perfetto (ui.perfetto.dev) and
`chrome://tracing` open, the format FSDP users read; the script prints each engine's ten ops with the most
self time, CUDA time first where there is a GPU. It runs on CPU ranks too (gloo), where it shows the same
split of a step between the engines' own Python, the model's ops and the collectives.
"""

from __future__ import annotations

import argparse
import os
import sys

import labkit
from labkit import cluster, traces
from labkit.engines.base import RunConfig
from labkit.engines.registry import ENGINES as REGISTERED

ENGINES = ("scratch", "fsdp2", "deepspeed", "ddp")


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
        table = labkit.launch(traces.trace_rank, world_size, engine, cfg, os.path.abspath(args.out))[0]
        print(f"## {engine}: {args.model}, {world_size} rank(s), step {args.steps - 1} (rank 0)\n{table}")
        print(
            f"trace: {traces.trace_path(args.out, engine, 0)} and the other ranks' (open in ui.perfetto.dev)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
