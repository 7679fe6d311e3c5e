"""What a gloo collective costs the CPU: wall and CPU milliseconds per call, on one block's bytes.

    python benchmarks/gloo_cpu.py [--model small] [--reps 9] [--out benchmarks/results-calibrated.md]

On CPU a rank's collectives run on the cores its compute needs, so a collective that prefetch hides behind
compute still slows that compute by its CPU time. For one block of `--model` at 2 ranks (fp32, padded as the
scratch engine shards it): the all-gather of its weights; the reduce-scatter of its gradients, which gloo runs
as an all-reduce inside; and, to compare, an all-to-all of the same buffer plus a local sum, which moves the
reduce-scatter's bytes ((n-1)/n of the buffer per rank) and sums once. CPU time is the rank process's, every
thread (gloo's own included); figures are rank 0's medians over `reps` calls after a warm-up call.
It writes its section into `--out` in place (calibrated.py writes the rest and calls it too).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from sections import write_section  # benchmarks/sections.py (a script's own folder is on sys.path)

import labkit
from labkit.budget import collective_wire_bytes, padded_numel
from labkit.model import build_model

SECTION = "## What gloo's collectives cost the CPU"
RANKS = 2


def block_numel(model: str) -> int:
    """Elements of block 0 of `model`, each parameter padded on dim 0 to a multiple of RANKS."""
    return sum(padded_numel(tuple(p.shape), RANKS) for p in build_model(model).blocks[0].parameters())


def _calls_on_rank(numel: int, reps: int) -> dict[str, tuple[float, float]]:
    """{collective: (median wall s, median CPU s)} of `reps` calls on this rank, on a `numel`-element buffer."""
    torch.set_num_threads(1)
    n = dist.get_world_size()
    shard, gathered = torch.randn(numel // n), torch.empty(numel)
    full, exchanged, mine = torch.randn(numel), torch.empty(numel), torch.empty(numel // n)
    calls = {
        "all_gather": lambda: dist.all_gather_single(gathered, shard),
        "reduce_scatter": lambda: dist.reduce_scatter_single(mine, full),
        "all_to_all + sum": lambda: (
            dist.all_to_all_single(exchanged, full),
            torch.sum(exchanged.view(n, -1), 0, out=mine),
        ),
    }
    seen: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    for _ in range(reps + 1):
        for name, call in calls.items():
            dist.barrier()
            wall_s, cpu_s = time.perf_counter(), time.process_time()
            call()
            seen[name].append((time.perf_counter() - wall_s, time.process_time() - cpu_s))
    return {name: tuple(statistics.median(x) for x in zip(*s[1:], strict=True)) for name, s in seen.items()}


def measure(model: str = "small", reps: int = 9) -> dict:
    numel = block_numel(model)
    return {"model": model, "numel": numel, "calls": labkit.launch(_calls_on_rank, RANKS, numel, reps)[0]}


def section_lines(result: dict) -> list[str]:
    wire = collective_wire_bytes("reduce_scatter", 4 * result["numel"], RANKS)  # the same for all three
    rows = [
        f"{SECTION} (one block of `{result['model']}`, {result['numel']:,} fp32 elements, {RANKS} ranks; "
        f"{wire / 1e6:.2f} MB on the wire per rank for each; rank 0, medians)",
        "",
        "| collective | wall ms | CPU ms (every thread of the rank) |",
        "|---|---|---|",
    ]
    for name, (wall_s, cpu_s) in result["calls"].items():
        rows.append(f"| {name} | {wall_s * 1e3:.2f} | {cpu_s * 1e3:.2f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", default="benchmarks/results-calibrated.md")
    args = parser.parse_args(argv)
    lines = section_lines(measure(args.model, args.reps))
    print("\n".join(lines))
    write_section(args.out, SECTION, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
